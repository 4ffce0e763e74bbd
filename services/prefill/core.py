"""Prefill core: a metadata-only request -> embeddings read from the encoders -> KV cache in this
process's pool (for decode to read) + the first token.

The embeddings are read with one batched fetch and acknowledged (the encoders free their slots);
ours go back once the engine is done. The KV cache of one request is one lease, freed by decode's
completion notification, `ReleaseLeases`, or expiry. An embedding that is gone (lease expired,
encoder restarted or dead) fails the request with NOT_FOUND / UNAVAILABLE so the router can
re-encode; the service keeps serving.
"""

from __future__ import annotations

from libs.contract.epd.v1 import prefill_pb2, tensor_pb2
from libs.contract.validation import Limits, validate_prefill_request
from libs.runtime.prefill_runner import PrefillRunner
from libs.serving import convert
from libs.serving.compute_thread import ComputeThread
from libs.serving.generation import fetch_and_prefill
from libs.serving.transport import Transport
from libs.telemetry.stages import stage


class PrefillCore:
    def __init__(
        self,
        runner: PrefillRunner,
        transport: Transport,
        engine: ComputeThread,
        *,
        limits: Limits | None = None,
    ) -> None:
        self.runner = runner
        self.transport = transport
        self.engine = engine
        self.limits = limits or Limits()

    async def prefill(self, request: prefill_pb2.PrefillRequest, deadline: float | None) -> prefill_pb2.PrefillResponse:
        validate_prefill_request(request, self.limits)
        sampling = convert.sampling_to_engine(request.sampling)
        result = await fetch_and_prefill(self.engine, self.runner, self.transport, request.messages, sampling, deadline)
        response = prefill_pb2.PrefillResponse(
            first_chunk=convert.chunk_to_wire(result.first_chunk),
            decode_state=convert.decode_state_to_wire(result.decode_state),
        )
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
