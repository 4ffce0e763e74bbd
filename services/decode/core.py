"""Decode core: a KV cache exported by prefill -> read into this process, acknowledged (prefill
frees its slot), copied out of the pool slot (which goes straight back), and decoded in the shared
batched loop; tokens are streamed. A stream that ends early (client cancel, deadline) leaves the
batch; other sequences are unaffected."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from libs.contract.epd.v1 import decode_pb2
from libs.contract.errors import DeadlineExceeded
from libs.contract.reasons import Reason
from libs.contract.validation import Limits, validate_decode_request
from libs.runtime import types as eng
from libs.runtime.kv import cross_kv_names, kv_names
from libs.runtime.lm_runtime import LanguageModelRuntime
from libs.serving import convert
from libs.serving.compute_thread import DecodeLoop
from libs.serving.generation import decode_stream
from libs.serving.transport import Transport, transport_name
from libs.telemetry.stages import record_transfer, stage
from libs.transfer import ExpectedTensor


class DecodeCore:
    def __init__(
        self, runtime: LanguageModelRuntime, loop: DecodeLoop, transport: Transport, *, limits: Limits | None = None
    ) -> None:
        self.runtime = runtime
        self.loop = loop
        self.transport = transport
        self.limits = limits or Limits()

    async def decode(
        self, request: decode_pb2.DecodeRequest, deadline: float | None
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        validate_decode_request(request, self.limits)
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
