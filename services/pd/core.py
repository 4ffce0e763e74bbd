"""Prefill-decode core (E+PD layout): a metadata-only request -> embeddings read from the encoders
-> prefill and decode in this process, no KV transfer; tokens are streamed."""

from __future__ import annotations

from collections.abc import AsyncIterator

from libs.contract.epd.v1 import prefill_decode_pb2
from libs.contract.validation import Limits, validate_prefill_decode_request
from libs.engine.prefill_runner import PrefillRunner
from libs.serving import convert
from libs.serving.engine_loop import DecodeLoop, EngineThread
from libs.serving.generation import fetch_and_prefill, stream_after_prefill
from libs.serving.transport import Transport


class PrefillDecodeCore:
    def __init__(
        self,
        runner: PrefillRunner,
        loop: DecodeLoop,
        transport: Transport,
        engine: EngineThread,
        *,
        limits: Limits | None = None,
    ) -> None:
        self.runner = runner
        self.loop = loop
        self.transport = transport
        self.engine = engine
        self.limits = limits or Limits()

    async def generate(
        self, request: prefill_decode_pb2.PrefillDecodeRequest, deadline: float | None
    ) -> AsyncIterator[prefill_decode_pb2.PrefillDecodeResponse]:
        validate_prefill_decode_request(request, self.limits)
        sampling = convert.sampling_to_engine(request.sampling)
        result = await fetch_and_prefill(self.engine, self.runner, self.transport, request.messages, sampling, deadline)
        async for chunk, usage in stream_after_prefill(self.loop, request.request_id, result, sampling):
            response = prefill_decode_pb2.PrefillDecodeResponse(chunk=chunk)
            if usage is not None:
                response.usage.CopyFrom(usage)
            yield response
