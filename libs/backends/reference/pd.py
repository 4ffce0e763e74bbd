"""Prefill + decode on the reference runtime (the PD role of the E+PD layout): embeddings read over
the service's own transport, prefill on the compute thread, then the shared batched decode loop;
no KV transfer."""

from __future__ import annotations

from collections.abc import AsyncIterator

import torch

from libs.backends.api import PrefillDecodeBackend
from libs.backends.engines import capability
from libs.backends.in_flight import InFlight
from libs.backends.settings import PrefillDecodeEngineSettings
from libs.contract.epd.v1 import prefill_decode_pb2, service_info_pb2
from libs.model import types as eng
from libs.runtime import prefix_cache
from libs.runtime.decode_runner import DecodeRunner
from libs.runtime.lm_runtime import LanguageModelRuntime
from libs.runtime.prefill_runner import CHUNK_TOKENS, PrefillRunner
from libs.serving import convert
from libs.serving.compute_thread import ComputeThread, DecodeLoop
from libs.serving.generation import fetch_and_prefill, held_items_capability, stream_after_prefill
from libs.serving.service_info import model_identity
from libs.serving.speech import speech_capabilities, transcription_spec
from libs.serving.transport import Transport, transfer_config


class ReferencePrefillDecode(PrefillDecodeBackend):
    """`PrefillDecodeBackend` on libs/runtime."""

    name = "reference"
    transport: Transport  # the service's: this backend moves every tensor with it

    def __init__(
        self,
        runtime: LanguageModelRuntime,
        transport: Transport,
        *,
        max_batch: int,
        max_running: int,
        chunk_tokens: int = CHUNK_TOKENS,
        prefix_cache_mib: int = 0,
    ) -> None:
        self.runtime = runtime
        self.weights_digest = self.runtime.weights_digest
        self.transport = transport
        # It runs at most its batch: the rest wait in admission (priority orders them there).
        self.max_running = min(max_running, max_batch)
        self.in_flight = InFlight()
        self.thread = ComputeThread("pd")
        self.runner = PrefillRunner(
            self.runtime, chunk_tokens=chunk_tokens, prefix_cache=prefix_cache.of_size(prefix_cache_mib, chunk_tokens)
        )
        self.loop = DecodeLoop(DecodeRunner(self.runtime, max_batch=max_batch), self.thread)

    def embedding_specs(self) -> list[eng.EmbeddingSpec]:
        return self.runtime.expected_specs()

    def capabilities(self) -> tuple[str, ...]:
        return (capability(self.name), *held_items_capability(self.runner), *speech_capabilities(self.runtime.adapter))

    def extend_info(self, info: service_info_pb2.ServiceInfo) -> None:
        if (spec := transcription_spec(self.runtime.adapter)) is not None:
            info.transcription.CopyFrom(spec)

    @property
    def active(self) -> int:
        return self.loop.active

    async def generate(
        self, request: prefill_decode_pb2.PrefillDecodeRequest, deadline: float | None
    ) -> AsyncIterator[prefill_decode_pb2.PrefillDecodeResponse]:
        with self.in_flight.track(request.request_id):
            sampling = convert.sampling_to_engine(request.sampling)
            result = await fetch_and_prefill(
                self.thread, self.runner, self.transport, request.messages, sampling, deadline, request.cache_salt
            )
            async for chunk, usage in stream_after_prefill(self.loop, request.request_id, result, sampling):
                response = prefill_decode_pb2.PrefillDecodeResponse(chunk=chunk)
                if usage is not None:
                    response.usage.CopyFrom(usage)
                yield response

    async def close(self) -> None:
        self.thread.shutdown()
        self.transport.close()


async def start(settings: PrefillDecodeEngineSettings) -> ReferencePrefillDecode:
    """Load the model; the transport only consumes (the encoders' embeddings)."""
    torch.set_num_threads(settings.torch_threads)
    runtime = LanguageModelRuntime(settings.model)
    identity = model_identity(settings, runtime.weights_digest)
    transport = Transport(transfer_config(settings, "pd"), identity, produce=False, consume=True)
    return ReferencePrefillDecode(
        runtime,
        transport,
        max_batch=settings.max_batch,
        max_running=settings.max_running,
        chunk_tokens=settings.prefill_chunk_tokens,
        prefix_cache_mib=settings.prefix_cache_mib,
    )
