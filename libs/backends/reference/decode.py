"""Decode on the reference runtime (the D role of the E/P/D layout): a KV cache exported by
prefill -> read into this process over the service's transport, acknowledged (prefill frees its
slot), copied out of the pool slot (which goes straight back), and decoded in the shared batched
loop; tokens are streamed. A stream that ends early (client cancel, deadline) leaves the batch;
other sequences are unaffected."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import torch

from libs.backends.api import DecodeBackend
from libs.backends.in_flight import InFlight
from libs.backends.settings import EngineSettings
from libs.contract.epd.v1 import decode_pb2
from libs.contract.errors import DeadlineExceeded
from libs.contract.reasons import Reason
from libs.model import types as eng
from libs.runtime.decode_runner import DecodeRunner
from libs.runtime.kv import cross_kv_names, kv_names
from libs.runtime.lm_runtime import LanguageModelRuntime
from libs.serving import convert
from libs.serving.compute_thread import ComputeThread, DecodeLoop
from libs.serving.generation import decode_stream
from libs.serving.service_info import model_identity
from libs.serving.speech import speech_capabilities
from libs.serving.transport import Transport, transfer_config, transport_name
from libs.telemetry.stages import record_transfer, stage
from libs.transfer import ExpectedTensor


class ReferenceDecode(DecodeBackend):
    """`DecodeBackend` on libs/runtime."""

    name = "reference"
    transport: Transport  # the service's: this backend moves every tensor with it

    def __init__(
        self, runtime: LanguageModelRuntime, transport: Transport, *, max_batch: int, max_running: int
    ) -> None:
        self.runtime = runtime
        self.weights_digest = runtime.weights_digest
        self.transport = transport
        # Requests beyond the decode batch wait in admission instead of failing in the runner.
        self.max_running = min(max_running, max_batch)
        self.in_flight = InFlight()
        self.thread = ComputeThread("decode")
        self.loop = DecodeLoop(DecodeRunner(runtime, max_batch=max_batch), self.thread)

    @property
    def active(self) -> int:
        return self.loop.active

    def capabilities(self) -> tuple[str, ...]:
        return speech_capabilities(self.runtime.adapter)

    async def decode(
        self, request: decode_pb2.DecodeRequest, deadline: float | None
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        with self.in_flight.track(request.request_id):
            kv = await self._read_kv(request, deadline)
            state = convert.decode_state_to_engine(request.decode_state)
            sampling = convert.sampling_to_engine(request.sampling)
            async for chunk, usage in decode_stream(self.loop, request.request_id, kv, state, sampling):
                response = decode_pb2.DecodeResponse(chunk=chunk)
                if usage is not None:
                    response.usage.CopyFrom(usage)
                yield response

    async def _read_kv(self, request: decode_pb2.DecodeRequest, deadline: float | None) -> eng.KvCache:
        layout = convert.kv_layout_to_engine(request.kv_cache.layout)
        shape = (layout.num_kv_heads, layout.num_tokens, layout.head_dim)
        dtype = request.kv_cache.layout.dtype
        expected = {name: ExpectedTensor(dtype, shape) for i in range(layout.num_layers) for name in kv_names(i)}
        if layout.cross_tokens:  # encoder-decoder (contract 1.4): each layer's cross-attention KV too
            cross_shape = (layout.num_kv_heads, layout.cross_tokens, layout.head_dim)
            for i in range(layout.num_layers):
                expected.update((name, ExpectedTensor(dtype, cross_shape)) for name in cross_kv_names(i))
        timeout = None
        if deadline is not None:
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                raise DeadlineExceeded("deadline passed before the KV cache was read")
        assert self.transport.consumer is not None
        handle = request.kv_cache.handle
        with stage("kv.transfer", "transfer") as span:
            started = time.perf_counter()
            received = await self.transport.run(
                self.transport.consumer.fetch,
                handle,
                expected=expected,
                timeout_s=timeout,
                on_abandon=lambda r: r.release(),
                gone=Reason.KV_GONE,
            )
            try:
                # Our own copy: the decode batch outlives the request's slot, which goes back now.
                tensors = {name: t.clone() for name, t in received.tensors.items()}
            finally:
                received.release()
            record_transfer(
                span,
                nbytes=received.nbytes,
                seconds=time.perf_counter() - started,
                transport=transport_name([handle]),
                peers=1,
                direction="prefill->decode",
            )
        # The producer's model identity was checked at first contact (ServiceInfo handshake in the
        # metadata resolver), so the cache comes from these weights.
        return eng.KvCache(layout, tensors, weights_digest=self.runtime.weights_digest)

    async def close(self) -> None:
        self.thread.shutdown()
        self.transport.close()


async def start(settings: EngineSettings) -> ReferenceDecode:
    """Load the model; the transport only consumes (the KV caches prefill exported)."""
    torch.set_num_threads(settings.torch_threads)
    runtime = LanguageModelRuntime(settings.model)
    identity = model_identity(settings, runtime.weights_digest)
    transport = Transport(transfer_config(settings, "decode"), identity, produce=False, consume=True)
    return ReferenceDecode(runtime, transport, max_batch=settings.max_batch, max_running=settings.max_running)
