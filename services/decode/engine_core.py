"""Decode on an engine that reads the KV cache itself (vLLM: its KV connector READs prefill's
paged blocks): validate the request, then stream what the engine generates."""

from __future__ import annotations

from collections.abc import AsyncIterator

from libs.backends.api import DecodeEngine
from libs.contract.epd.v1 import decode_pb2
from libs.contract.validation import Limits, validate_decode_request


class EngineDecodeCore:
    def __init__(self, engine: DecodeEngine, *, limits: Limits | None = None) -> None:
        self.engine = engine
        self.limits = limits or Limits()

    async def decode(
        self, request: decode_pb2.DecodeRequest, deadline: float | None
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        validate_decode_request(request, self.limits)
        async for chunk, usage in self.engine.decode(request, deadline):
            response = decode_pb2.DecodeResponse(chunk=chunk)
            if usage is not None:
                response.usage.CopyFrom(usage)
            yield response
