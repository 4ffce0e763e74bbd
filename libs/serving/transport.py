"""A service's tensor transport: its NIXL agent, producer and/or consumer, bound to gRPC.

- Agent metadata is resolved with `GetServiceInfo` on the producer's address (the handle's
  `NixlAgentRef.producer_address`), after checking the peer's contract version and model identity
  (first contact); the transfer library caches it per incarnation.
- Blocking transfer calls run on a small thread pool of their own, so READs overlap model compute.
- Transfer errors become typed contract errors with the same status code, and a reason where the
  failure has one: a read of data that is no longer there carries the reason the caller names
  (EMBEDDING_GONE, KV_GONE), a full pool OVERLOADED, our own agent closed SERVER_STOPPED.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

import grpc

from libs.contract import version
from libs.contract.epd.v1 import (
    service_info_pb2,
    service_info_pb2_grpc,
    stats_pb2,
    tensor_pb2,
)
from libs.contract.errors import EpdError, error_for
from libs.contract.reasons import Reason, reason_if_gone
from libs.rpc.peers import check_peer
from libs.rpc.server import sync_channel
from libs.serving.settings import ModelServiceSettings
from libs.transfer import (
    AgentClosed,
    AgentMetadata,
    PeerUnavailable,
    PoolExhausted,
    TensorConsumer,
    TensorProducer,
    TransferAgent,
    TransferConfig,
    TransferError,
)
from libs.transfer.stamp import CAPABILITY as STAMP_CAPABILITY
from libs.transfer.stamp import CHECKSUMS_CAPABILITY

T = TypeVar("T")

PRODUCER_ROLES = (
    service_info_pb2.SERVICE_ROLE_ENCODER,
    service_info_pb2.SERVICE_ROLE_PREFILL,
)


def _reason(exc: TransferError, gone: Reason | None) -> Reason | None:
    if isinstance(exc, AgentClosed):
        return Reason.SERVER_STOPPED  # this process is shutting down, not the peer
    if isinstance(exc, PoolExhausted):
        return Reason.OVERLOADED
    return None if gone is None else reason_if_gone(exc.grpc_code, gone)


@contextmanager
def transfer_errors(gone: Reason | None = None) -> Iterator[None]:
    """Re-raise transfer errors as contract errors carrying the same gRPC code; `gone` is the
    reason of a read whose data is no longer there (NOT_FOUND, UNAVAILABLE, DATA_LOSS)."""
    try:
        yield
    except TransferError as exc:
        field = getattr(exc, "field", "") or "handle"
        raise error_for(exc.grpc_code, exc.message, field, reason=_reason(exc, gone)) from exc


def transport_name(handles: Sequence[tensor_pb2.TensorHandle]) -> str:
    """ "nixl", "inline" or "mixed", for span attributes."""
    kinds = {tensor_pb2.TransportKind.Name(h.transport).removeprefix("TRANSPORT_KIND_").lower() for h in handles}
    return kinds.pop() if len(kinds) == 1 else "mixed"


def transfer_config(settings: ModelServiceSettings, role: str) -> TransferConfig:
    """The transport configuration of a model service."""
    return TransferConfig(
        agent_name_prefix=role,
        pool_bytes=settings.pool_mib << 20,
        lease_ttl_s=settings.lease_ttl_s,
        checksum=settings.checksum,
        verify_checksum=settings.checksum,
        poison_freed=settings.poison_freed,
        # Tensor bytes inside a request: only from callers mutual TLS authenticated, or when asked.
        accept_inline=settings.accept_inline_tensors or settings.tls_ca is not None,
        ucx_net_devices=settings.ucx_net_devices,
        extra_env=(("UCX_TLS", settings.ucx_tls),) if settings.ucx_tls else (),
    )


class MetadataResolver:
    """Fetches a producer's NIXL agent metadata from its `ServiceInfo` (called on transfer threads)."""

    def __init__(self, model: service_info_pb2.ModelIdentity, timeout_s: float = 5.0) -> None:
        self._model = model
        self._timeout_s = timeout_s
        self._channels: dict[str, grpc.Channel] = {}
        self.infos: dict[str, service_info_pb2.ServiceInfo] = {}  # producer address -> last info seen

    def __call__(self, ref: tensor_pb2.NixlAgentRef) -> AgentMetadata:
        address = ref.producer_address
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = sync_channel(address)
        stub = service_info_pb2_grpc.ServiceInfoServiceStub(channel)
        try:
            reply = stub.GetServiceInfo(
                service_info_pb2.GetServiceInfoRequest(caller_contract_version=version.current()),
                timeout=self._timeout_s,
            )
        except grpc.RpcError as exc:
            raise PeerUnavailable(f"producer {address} unreachable: {exc.code().name}") from None
        try:
            check_peer(reply.info, address, roles=PRODUCER_ROLES, model=self._model)
        except EpdError as exc:
            raise PeerUnavailable(str(exc)) from None
        self.infos[address] = reply.info
        for transport in reply.info.transports:
            if transport.kind == tensor_pb2.TRANSPORT_KIND_NIXL and transport.nixl.agent_name == ref.agent_name:
                capabilities = set(reply.info.capabilities)
                return AgentMetadata(
                    bytes(transport.nixl.metadata),
                    lease_stamps=STAMP_CAPABILITY in capabilities,
                    checksums=CHECKSUMS_CAPABILITY in capabilities,
                )
        raise PeerUnavailable(f"producer {address} no longer runs agent {ref.agent_name}")

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()


class Transport:
    """One process's transfer endpoint (agent + optional producer/consumer) and its threads."""

    def __init__(
        self,
        config: TransferConfig,
        model: service_info_pb2.ModelIdentity,
        *,
        produce: bool,
        consume: bool,
        threads: int = 2,
    ) -> None:
        self.agent = TransferAgent(config)
        self.resolver = MetadataResolver(model)
        self.consumer = TensorConsumer(self.agent, self.resolver) if consume else None
        self._produce = produce
        self.producer: TensorProducer | None = None
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="transfer")

    def bind_address(self, address: str) -> None:
        """Producers need their own gRPC address (it goes into every handle); known after bind."""
        if self._produce and self.producer is None:
            self.producer = TensorProducer(self.agent, producer_address=address)

    async def run(
        self,
        fn: Callable[..., T],
        *args: Any,
        on_abandon: Callable[[T], object] | None = None,
        gone: Reason | None = None,
        **kwargs: Any,
    ) -> T:
        """Run a blocking transfer call on the transfer threads. If the caller is cancelled
        (client gone, deadline) while it runs, `on_abandon` gets its result once it finishes, so
        slots and leases it took are given back instead of leaking. `gone`: the reason a failed
        read of data that is no longer there carries (`transfer_errors`)."""
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))
        try:
            with transfer_errors(gone):
                return await asyncio.shield(future)
        except asyncio.CancelledError:
            if on_abandon is not None:
                cleanup = on_abandon

                def give_back(done: asyncio.Future[T]) -> None:
                    if not done.cancelled() and done.exception() is None:
                        cleanup(done.result())

                future.add_done_callback(give_back)
            raise

    def transport_info(self) -> list[service_info_pb2.TransportInfo]:
        return [
            service_info_pb2.TransportInfo(kind=tensor_pb2.TRANSPORT_KIND_NIXL, nixl=self.agent.agent_info()),
            service_info_pb2.TransportInfo(kind=tensor_pb2.TRANSPORT_KIND_INLINE),
        ]

    @property
    def produces(self) -> bool:
        return self._produce

    def capabilities(self) -> list[str]:
        """What consumers of this producer's handles may rely on (advertised in ServiceInfo)."""
        if not self._produce:
            return []
        # Every slot our producer hands out carries a lease stamp; checksums as configured.
        return [STAMP_CAPABILITY, *([CHECKSUMS_CAPABILITY] if self.agent.config.checksum else [])]

    def held_leases(self) -> int:
        """Leases this process holds for consumers (0 without a producer)."""
        return self.producer.lease_stats().active if self.producer is not None else 0

    def stats(self) -> stats_pb2.TransferPoolStats:
        pool = self.agent.pool.stats()
        out = stats_pb2.TransferPoolStats(
            capacity_bytes=pool.capacity_bytes,
            slots_in_use=pool.slots_in_use,
            bytes_in_use=pool.bytes_in_use,
            quarantined_slots=pool.quarantined_slots,
        )
        if self.producer is not None:
            leases = self.producer.lease_stats()
            out.active_leases = leases.active
            out.acked_leases = leases.acked
            out.released_leases = leases.released
            out.expired_leases = leases.expired
        return out

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        self.resolver.close()
        self.agent.close()
