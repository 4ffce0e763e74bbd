"""Prefill + decode on the reference runtime: embeddings read over the service's own transport,
prefill on the engine thread, then the shared batched decode loop."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from libs.backends.api import Streamed
from libs.contract.epd.v1 import chat_pb2
from libs.runtime import types as eng
from libs.runtime.decode_runner import DecodeRunner
from libs.runtime.lm_runtime import LanguageModelRuntime
from libs.runtime.prefill_runner import CHUNK_TOKENS, PrefillRunner
from libs.serving.compute_thread import ComputeThread, DecodeLoop
from libs.serving.generation import fetch_and_prefill, stream_after_prefill
from libs.serving.transport import Transport


class ReferencePrefillDecode:
    """`PrefillDecodeEngine` on libs/runtime."""

    name = "reference"

    def __init__(
        self, runtime: LanguageModelRuntime, transport: Transport, *, max_batch: int, chunk_tokens: int = CHUNK_TOKENS
    ) -> None:
        self.runtime = runtime
        self.weights_digest = self.runtime.weights_digest
        self.thread = ComputeThread("pd")
        self.runner = PrefillRunner(self.runtime, chunk_tokens=chunk_tokens)
        self.loop = DecodeLoop(DecodeRunner(self.runtime, max_batch=max_batch), self.thread)
        self._transport = transport

    def expected_specs(self) -> list[eng.EmbeddingSpec]:
        return self.runtime.expected_specs()

    @property
    def active(self) -> int:
        return self.loop.active

    async def generate(
        self,
        request_id: str,
        messages: Sequence[chat_pb2.ChatMessage],
        sampling: eng.SamplingParams,
        deadline: float | None,
        priority: int = 0,  # ordered by the service's admission: this engine runs what it admitted
    ) -> AsyncIterator[Streamed]:
        result = await fetch_and_prefill(self.thread, self.runner, self._transport, messages, sampling, deadline)
        async for item in stream_after_prefill(self.loop, request_id, result, sampling):
            yield item

    async def close(self) -> None:
        self.thread.shutdown()
