"""The whole pipeline on the reference runtime in one process (the colocated role): encode,
prefill and decode on one compute thread, no transfers. It is the baseline every disaggregated
layout must match token for token."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import torch

from libs.backends.api import ColocatedBackend
from libs.backends.in_flight import InFlight
from libs.backends.settings import ColocatedBackendSettings
from libs.contract.epd.v1 import generate_pb2
from libs.contract.errors import InvalidArgument
from libs.contract.validation import Limits
from libs.model import types as eng
from libs.model.types import EncodedItem, MediaInput
from libs.runtime import prefix_cache
from libs.runtime.decode_runner import DecodeRunner
from libs.runtime.encoder_runner import EncoderRunner
from libs.runtime.lm_runtime import LanguageModelRuntime
from libs.runtime.prefill_runner import CHUNK_TOKENS, PrefillRunner
from libs.serving import convert
from libs.serving.compute_thread import ComputeThread, DecodeLoop
from libs.serving.embeddings import FetchedItems
from libs.serving.encoding import encode_items
from libs.serving.generation import run_prefill, stream_after_prefill
from libs.serving.media_source import media_bytes


class ReferenceColocated(ColocatedBackend):
    """`ColocatedBackend` on libs/runtime: serves `GenerateRequest`s from one checkpoint."""

    name = "reference"

    def __init__(
        self,
        model: Path,
        *,
        max_batch: int = 8,
        max_running: int = 16,
        limits: Limits | None = None,
        file_root: Path | None = None,
        chunk_tokens: int = CHUNK_TOKENS,
        prefix_cache_mib: int = 0,
    ) -> None:
        self.limits = limits or Limits()
        self.file_root = file_root
        self.encoder = EncoderRunner(model)
        self.runtime = LanguageModelRuntime(model)
        self.weights_digest = self.runtime.weights_digest
        # It runs at most its decode batch: the rest wait in admission.
        self.max_running = min(max_running, max_batch)
        self.in_flight = InFlight()
        self.prefill = PrefillRunner(
            self.runtime, chunk_tokens=chunk_tokens, prefix_cache=prefix_cache.of_size(prefix_cache_mib, chunk_tokens)
        )
        self.thread = ComputeThread("colocated")
        self.decode = DecodeLoop(DecodeRunner(self.runtime, max_batch=max_batch), self.thread)

    @property
    def active(self) -> int:
        return self.decode.active

    def embedding_specs(self) -> list[eng.EmbeddingSpec]:
        return list(self.encoder.specs.values())

    async def generate(
        self, request: generate_pb2.GenerateRequest, deadline: float | None
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """`request.request_id` is set (the service's core names a request that came without one)."""
        request_id = request.request_id
        with self.in_flight.track(request_id):
            media = []
            for index, part in enumerate(convert.media_parts(request.messages)):
                data = media_bytes(
                    part.media,
                    f"media item {index}",
                    max_bytes=self.limits.max_inline_media_bytes,
                    file_root=self.file_root,
                )
                media.append(convert.media_input(part.media, index, data))
            items = await self._encode(media) if media else []
            sampling = convert.sampling_to_engine(request.sampling)
            result = await run_prefill(
                self.thread, self.prefill, request.messages, sampling, FetchedItems(items), request.cache_salt
            )
            async for chunk, usage in stream_after_prefill(self.decode, request_id, result, sampling):
                response = generate_pb2.GenerateResponse(request_id=request_id, chunk=chunk)
                if usage is not None:
                    response.usage.CopyFrom(usage)
                yield response

    async def _encode(self, media: list[MediaInput]) -> list[EncodedItem]:
        """All items in one compute call; bad media are named `media item <i>`, as the router names
        them (its encoders see one item per job), so a client gets the same error in every layout."""
        try:
            return await encode_items(self.thread, self.encoder, media)
        except InvalidArgument as exc:
            culprit = 0
            if len(media) > 1:  # the compute call does not say which item failed: find it (error path only)
                for index, item in enumerate(media):
                    try:
                        await encode_items(self.thread, self.encoder, [item])
                    except InvalidArgument:
                        culprit = index
                        break
                else:
                    raise
            raise InvalidArgument(f"media item {culprit}", str(exc)) from exc

    async def close(self) -> None:
        self.thread.shutdown()


async def start(settings: ColocatedBackendSettings) -> ReferenceColocated:
    torch.set_num_threads(settings.torch_threads)
    return ReferenceColocated(
        settings.model,
        max_batch=settings.max_batch,
        max_running=settings.max_running,
        file_root=settings.file_root,
        chunk_tokens=settings.prefill_chunk_tokens,
        prefix_cache_mib=settings.prefix_cache_mib,
    )
