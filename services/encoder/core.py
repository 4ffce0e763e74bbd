"""Encoder core: an `EncodeRequest`, validated, handed to the service's backend (`EncoderBackend`:
the reference runtime's tower, output cache and registered pool, libs/backends/reference/encoder.py),
which returns each item's layout and the handle of its embeddings."""

from __future__ import annotations

from libs.backends.api import EncoderBackend
from libs.contract.epd.v1 import encoder_pb2
from libs.contract.validation import Limits, validate_encode_request


class EncoderCore:
    def __init__(self, backend: EncoderBackend, *, limits: Limits | None = None) -> None:
        self.backend = backend
        self.limits = limits or Limits()

    async def encode(self, request: encoder_pb2.EncodeRequest, deadline: float | None) -> encoder_pb2.EncodeResponse:
        validate_encode_request(request, self.limits)
        return await self.backend.encode(request, deadline)
