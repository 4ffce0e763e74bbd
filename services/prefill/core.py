"""Prefill core: a metadata-only request, validated, handed to whichever backend the service runs
(`PrefillBackend`: the reference runtime reads the embeddings over the service's transport and
publishes the KV in its pool; vLLM reads them in its worker and keeps the KV in its blocks)."""

from __future__ import annotations

from libs.backends.api import PrefillBackend
from libs.contract.epd.v1 import prefill_pb2
from libs.contract.validation import Limits, validate_prefill_request


class PrefillCore:
    def __init__(self, backend: PrefillBackend, *, limits: Limits | None = None) -> None:
        self.backend = backend
        self.limits = limits or Limits()

    async def prefill(self, request: prefill_pb2.PrefillRequest, deadline: float | None) -> prefill_pb2.PrefillResponse:
        validate_prefill_request(request, self.limits)
        return await self.backend.prefill(request, deadline)
