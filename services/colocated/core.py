"""Colocated core: one process runs encode, prefill and decode on one engine thread. It is the
baseline every disaggregated layout must match token for token, and serves `Generate` itself."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from libs.contract.epd.v1 import generate_pb2
from libs.contract.validation import Limits, validate_generate_request
from libs.engine.decode_runner import DecodeRunner
from libs.engine.encoder_runner import EncoderRunner
from libs.engine.lm_runtime import LanguageModelRuntime
from libs.engine.prefill_runner import PrefillRunner
from libs.serving import convert
from libs.serving.embeddings import FetchedItems
from libs.serving.encoding import encode_items
from libs.serving.engine_loop import DecodeLoop, EngineThread
from libs.serving.generation import run_prefill, stream_after_prefill
from libs.serving.media_source import media_bytes


class ColocatedCore:
    """Serves `GenerateRequest`s from one checkpoint, no sockets involved."""

    def __init__(
        self, model: Path, *, max_batch: int = 8, limits: Limits | None = None, file_root: Path | None = None
    ) -> None:
        self.limits = limits or Limits()
        self.file_root = file_root
        self.encoder = EncoderRunner(model)
        self.runtime = LanguageModelRuntime(model)
        self.prefill = PrefillRunner(self.runtime)
        self.engine = EngineThread("colocated")
        self.decode = DecodeLoop(DecodeRunner(self.runtime, max_batch=max_batch), self.engine)

    async def generate(self, request: generate_pb2.GenerateRequest) -> AsyncIterator[generate_pb2.GenerateResponse]:
        validate_generate_request(request, self.limits)
        request_id = request.request_id or uuid.uuid4().hex
        media = []
        for index, part in enumerate(convert.media_parts(request.messages)):
            data = media_bytes(
                part.media,
                f"media item {index}",
                max_bytes=self.limits.max_inline_media_bytes,
                file_root=self.file_root,
            )
            media.append(convert.media_input(part.media, index, data))
        items = await encode_items(self.engine, self.encoder, media, "media") if media else []
        sampling = convert.sampling_to_engine(request.sampling)
        result = await run_prefill(self.engine, self.prefill, request.messages, sampling, FetchedItems(items))
        async for chunk, usage in stream_after_prefill(self.decode, request_id, result, sampling):
            response = generate_pb2.GenerateResponse(request_id=request_id, chunk=chunk)
            if usage is not None:
                response.usage.CopyFrom(usage)
            yield response
