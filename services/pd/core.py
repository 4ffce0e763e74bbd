"""Prefill-decode core (E+PD layout): a metadata-only request -> its engine (reference runtime or
vLLM) reads the embeddings from the encoders, prefills and decodes in this service, no KV
transfer; tokens are streamed."""

from __future__ import annotations

from collections.abc import AsyncIterator

from libs.backends.api import PrefillDecodeEngine
from libs.contract.epd.v1 import prefill_decode_pb2
from libs.contract.validation import Limits, validate_prefill_decode_request
from libs.serving import convert


class PrefillDecodeCore:
    def __init__(self, engine: PrefillDecodeEngine, *, limits: Limits | None = None) -> None:
        self.engine = engine
        self.limits = limits or Limits()

    async def generate(
        self, request: prefill_decode_pb2.PrefillDecodeRequest, deadline: float | None
    ) -> AsyncIterator[prefill_decode_pb2.PrefillDecodeResponse]:
        validate_prefill_decode_request(request, self.limits)
        sampling = convert.sampling_to_engine(request.sampling)
        stream = self.engine.generate(
            request.request_id, request.messages, sampling, deadline, priority=request.priority
        )
        async for chunk, usage in stream:
            response = prefill_decode_pb2.PrefillDecodeResponse(chunk=chunk)
            if usage is not None:
                response.usage.CopyFrom(usage)
            yield response
