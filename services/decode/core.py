"""Decode core: a KV handoff from prefill, validated, handed to whichever backend the service runs
(`DecodeBackend`: the reference runtime reads the KV over the service's transport and decodes in
its batched loop; vLLM's KV connector reads prefill's paged blocks); tokens are streamed."""

from __future__ import annotations

from collections.abc import AsyncIterator

from libs.backends.api import DecodeBackend
from libs.contract.epd.v1 import decode_pb2
from libs.contract.validation import Limits, validate_decode_request


class DecodeCore:
    def __init__(self, backend: DecodeBackend, *, limits: Limits | None = None) -> None:
        self.backend = backend
        self.limits = limits or Limits()

    async def decode(
        self, request: decode_pb2.DecodeRequest, deadline: float | None
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        validate_decode_request(request, self.limits)
        async for response in self.backend.decode(request, deadline):
            yield response
