"""Prefill-decode core (E+PD layout): a metadata-only request, validated, handed to whichever
backend the service runs (`PrefillDecodeBackend`: the reference runtime or vLLM reads the
embeddings from the encoders, prefills and decodes in this service, no KV transfer); tokens are
streamed."""

from __future__ import annotations

from collections.abc import AsyncIterator

from libs.backends.api import PrefillDecodeBackend
from libs.contract.epd.v1 import prefill_decode_pb2
from libs.contract.validation import Limits, validate_prefill_decode_request


class PrefillDecodeCore:
    def __init__(self, backend: PrefillDecodeBackend, *, limits: Limits | None = None) -> None:
        self.backend = backend
        self.limits = limits or Limits()

    async def generate(
        self, request: prefill_decode_pb2.PrefillDecodeRequest, deadline: float | None
    ) -> AsyncIterator[prefill_decode_pb2.PrefillDecodeResponse]:
        validate_prefill_decode_request(request, self.limits)
        async for response in self.backend.generate(request, deadline):
            yield response
