"""Prefill core: a metadata-only request, validated, handed to whichever backend the service runs
(`PrefillBackend`: the reference runtime reads the embeddings over the service's transport and
publishes the KV in its pool; vLLM reads them in its worker and keeps the KV in its blocks)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from libs.backends.api import PrefillBackend
from libs.contract.epd.v1 import media_pb2, prefill_pb2
from libs.contract.validation import Limits, validate_prefill_request
from libs.serving.raw_media import take_raw_media

# The P4 benchmark baseline only (libs/serving/raw_media.py): preprocesses the raw media taken out.
RawMedia = Callable[[list[tuple[media_pb2.MediaItem, int]]], Awaitable[None]]


class PrefillCore:
    def __init__(
        self, backend: PrefillBackend, *, limits: Limits | None = None, raw_media: RawMedia | None = None
    ) -> None:
        self.backend = backend
        self.limits = limits or Limits()
        self.raw_media = raw_media  # set with --accept-raw-media on the reference runtime

    async def prefill(self, request: prefill_pb2.PrefillRequest, deadline: float | None) -> prefill_pb2.PrefillResponse:
        raw = take_raw_media(request.messages) if self.raw_media is not None else []
        validate_prefill_request(request, self.limits)
        if self.raw_media is not None:
            await self.raw_media(raw)
        return await self.backend.prefill(request, deadline)
