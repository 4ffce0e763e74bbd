"""Prefill on an engine that runs the whole step itself (vLLM: reads the embeddings in its worker,
keeps the KV in its own blocks for decode): validate the request, then hand it to the engine."""

from __future__ import annotations

from libs.backends.api import PrefillEngine
from libs.contract.epd.v1 import prefill_pb2
from libs.contract.validation import Limits, validate_prefill_request


class EnginePrefillCore:
    def __init__(self, engine: PrefillEngine, *, limits: Limits | None = None) -> None:
        self.engine = engine
        self.limits = limits or Limits()

    async def prefill(self, request: prefill_pb2.PrefillRequest, deadline: float | None) -> prefill_pb2.PrefillResponse:
        validate_prefill_request(request, self.limits)
        return await self.engine.prefill(request, deadline)
