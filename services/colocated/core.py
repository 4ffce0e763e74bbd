"""Colocated core: a client's `GenerateRequest`, validated and named (a request without an id gets
one), handed to the service's backend (`ColocatedBackend`: encode, prefill and decode in this one
process, libs/backends/reference/colocated.py). It is the baseline every disaggregated layout must
match token for token, and serves `Generate` itself."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from libs.backends.api import ColocatedBackend
from libs.contract.epd.v1 import generate_pb2
from libs.contract.validation import Limits, validate_generate_request


class ColocatedCore:
    def __init__(self, backend: ColocatedBackend, *, limits: Limits | None = None) -> None:
        self.backend = backend
        self.limits = limits or Limits()

    async def generate(
        self, request: generate_pb2.GenerateRequest, deadline: float | None
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        validate_generate_request(request, self.limits)
        request.request_id = request.request_id or uuid.uuid4().hex
        async for response in self.backend.generate(request, deadline):
            yield response
