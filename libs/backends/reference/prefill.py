"""Prefill on the reference runtime (the P role of the E/P/D layout): embeddings read from the
encoders over the service's transport -> KV cache in this process's pool (for decode to read) +
the first token.

The embeddings are read with one batched fetch and acknowledged (the encoders free their slots);
ours go back once the runtime is done. The KV cache of one request is one lease, freed by decode's
completion notification, `ReleaseLeases`, or expiry. An embedding that is gone (lease expired,
encoder restarted or dead) fails the request with NOT_FOUND / UNAVAILABLE so the router can
re-encode; the service keeps serving.
"""

from __future__ import annotations

import torch

from libs.backends.api import PrefillBackend
from libs.backends.in_flight import InFlight
from libs.backends.settings import ChunkedEngineSettings
from libs.contract.epd.v1 import prefill_pb2, service_info_pb2, tensor_pb2
from libs.model import types as eng
from libs.runtime import prefix_cache
from libs.runtime.lm_runtime import LanguageModelRuntime
from libs.runtime.prefill_runner import CHUNK_TOKENS, PrefillRunner
from libs.serving import convert
from libs.serving.compute_thread import ComputeThread
from libs.serving.generation import fetch_and_prefill, held_items_capability
from libs.serving.service_info import model_identity
from libs.serving.speech import speech_capabilities, transcription_spec
from libs.serving.transport import Transport, transfer_config
from libs.telemetry.stages import stage


class ReferencePrefill(PrefillBackend):
    """`PrefillBackend` on libs/runtime."""

    name = "reference"
    transport: Transport  # the service's: this backend moves every tensor with it

    def __init__(
        self,
        runtime: LanguageModelRuntime,
        transport: Transport,
        *,
        max_running: int,
        chunk_tokens: int = CHUNK_TOKENS,
        prefix_cache_mib: int = 0,
    ) -> None:
        self.runtime = runtime
        self.weights_digest = runtime.weights_digest
        self.transport = transport
        self.max_running = max_running
        self.in_flight = InFlight()
        self.thread = ComputeThread("prefill")
        self.runner = PrefillRunner(
            runtime, chunk_tokens=chunk_tokens, prefix_cache=prefix_cache.of_size(prefix_cache_mib, chunk_tokens)
        )

    def embedding_specs(self) -> list[eng.EmbeddingSpec]:
        return self.runtime.expected_specs()

    def capabilities(self) -> tuple[str, ...]:
        return (*held_items_capability(self.runner), *speech_capabilities(self.runtime.adapter))

    def extend_info(self, info: service_info_pb2.ServiceInfo) -> None:
        if (spec := transcription_spec(self.runtime.adapter)) is not None:
            info.transcription.CopyFrom(spec)

    async def prefill(self, request: prefill_pb2.PrefillRequest, deadline: float | None) -> prefill_pb2.PrefillResponse:
        with self.in_flight.track(request.request_id):
            return await self._prefill(request, deadline)

    async def _prefill(
        self, request: prefill_pb2.PrefillRequest, deadline: float | None
    ) -> prefill_pb2.PrefillResponse:
        sampling = convert.sampling_to_engine(request.sampling)
        result = await fetch_and_prefill(
            self.thread, self.runner, self.transport, request.messages, sampling, deadline, request.cache_salt
        )
        response = prefill_pb2.PrefillResponse(
            first_chunk=convert.chunk_to_wire(result.first_chunk),
            decode_state=convert.decode_state_to_wire(result.decode_state),
        )
        response.decode_state.cache_salt = request.cache_salt  # contract 1.9: the tenant, for decode
        if result.kv_cache is not None:
            producer = self.transport.producer
            assert producer is not None, "the transport is bound once the server listens"
            put = (
                producer.put
                if tensor_pb2.TRANSPORT_KIND_NIXL in request.accepted_kv_transports
                else producer.put_inline
            )
            with stage("kv.publish", "transfer") as span:
                handle = await self.transport.run(
                    put, result.kv_cache.tensors, on_abandon=lambda h: producer.release([h.lease_id])
                )
                span.set_attribute("epd.transfer.bytes", sum(t.spec.nbytes for t in handle.tensors))
            response.kv_cache.CopyFrom(
                prefill_pb2.KvCache(layout=convert.kv_layout_to_wire(result.kv_cache.layout), handle=handle)
            )
        return response

    async def close(self) -> None:
        self.thread.shutdown()
        self.transport.close()


async def start(settings: ChunkedEngineSettings) -> ReferencePrefill:
    """Load the model; the transport produces (KV for decode) and consumes (the embeddings)."""
    torch.set_num_threads(settings.torch_threads)
    runtime = LanguageModelRuntime(settings.model)
    identity = model_identity(settings, runtime.weights_digest)
    transport = Transport(transfer_config(settings, "prefill"), identity, produce=True, consume=True)
    return ReferencePrefill(
        runtime,
        transport,
        max_running=settings.max_running,
        chunk_tokens=settings.prefill_chunk_tokens,
        prefix_cache_mib=settings.prefix_cache_mib,
    )
