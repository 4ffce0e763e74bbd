"""The `ServiceParts` of a model service: its own servicer plus what every model service has (stats,
leases when it produces tensors, drain on shutdown, engine and transport clean-up)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from libs.contract.epd.v1 import service_info_pb2
from libs.rpc.admission import Admission
from libs.rpc.drain import drainer
from libs.rpc.main import HealthSetter, Register, ServiceParts
from libs.serving.compute_thread import ComputeThread
from libs.serving.servicers import EngineLeases, engine_lease_servicer, lease_servicer, stats_servicer
from libs.serving.transport import Transport


def model_service_parts(
    servicer: tuple[Register, Any, str],
    *,
    admission: Admission,
    other_lanes: Sequence[Admission] = (),
    info: service_info_pb2.ServiceInfo,
    engine: ComputeThread | None,
    transport: Transport | None = None,
    active_sequences: Callable[[], int] = lambda: 0,
    on_close: Callable[[], None] = lambda: None,
    on_close_async: Callable[[], Awaitable[None]] | None = None,
    on_listening: Callable[[str], object] | None = None,
    health: Callable[[HealthSetter], None] | None = None,
    leases: EngineLeases | None = None,
) -> ServiceParts:
    """`leases`: tensors the engine itself holds for consumers (vLLM prefill's KV blocks), served
    by `LeaseService` and counted in the stats and the drain like a transport's."""
    servicers = [servicer]
    if transport is not None:
        info.capabilities.extend(c for c in transport.capabilities() if c not in info.capabilities)
    if transport is not None and transport.produces:
        servicers.append(lease_servicer(transport))
    if leases is not None:
        servicers.append(engine_lease_servicer(leases))
    lanes = (admission, *other_lanes)  # each admits its own kind of work
    pool = leases.pool_stats if leases is not None else None
    servicers.append(
        stats_servicer(transport, lambda: sum(a.running + a.waiting for a in lanes), active_sequences, pool)
    )

    async def close() -> None:
        on_close()
        if on_close_async is not None:
            await on_close_async()
        if engine is not None:
            engine.shutdown()
        if transport is not None:
            transport.close()

    return ServiceParts(
        servicers=servicers,
        info=lambda: info,
        close=close,
        drain=drainer(*lanes, held_leases=_held(transport, leases)),
        on_started=lambda address: _started(address, transport, on_listening),
        health=health,
    )


def _held(transport: Transport | None, leases: EngineLeases | None) -> Callable[[], int]:
    if transport is not None:
        return transport.held_leases
    if leases is not None:
        return leases.held
    return lambda: 0


def _started(address: str, transport: Transport | None, then: Callable[[str], object] | None) -> None:
    if transport is not None:
        transport.bind_address(address)
    if then is not None:
        then(address)
