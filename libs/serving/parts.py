"""The `ServiceParts` of a model service: its own servicer plus what every model service has (stats,
leases when it produces tensors, drain on shutdown, engine and transport clean-up)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from libs.contract.epd.v1 import service_info_pb2
from libs.rpc.admission import Admission
from libs.rpc.drain import drainer
from libs.rpc.main import HealthSetter, Register, ServiceParts
from libs.serving.engine_loop import EngineThread
from libs.serving.servicers import lease_servicer, stats_servicer
from libs.serving.transport import Transport


def model_service_parts(
    servicer: tuple[Register, Any, str],
    *,
    admission: Admission,
    other_lanes: Sequence[Admission] = (),
    info: service_info_pb2.ServiceInfo,
    engine: EngineThread | None,
    transport: Transport | None = None,
    active_sequences: Callable[[], int] = lambda: 0,
    on_close: Callable[[], None] = lambda: None,
    on_close_async: Callable[[], Awaitable[None]] | None = None,
    on_listening: Callable[[str], object] | None = None,
    health: Callable[[HealthSetter], None] | None = None,
) -> ServiceParts:
    servicers = [servicer]
    if transport is not None and transport.produces:
        servicers.append(lease_servicer(transport))
    if transport is not None:
        info.capabilities.extend(c for c in transport.capabilities() if c not in info.capabilities)
    lanes = (admission, *other_lanes)  # each admits its own kind of work
    servicers.append(stats_servicer(transport, lambda: sum(a.running + a.waiting for a in lanes), active_sequences))

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
        drain=drainer(*lanes, held_leases=transport.held_leases if transport is not None else lambda: 0),
        on_started=lambda address: _started(address, transport, on_listening),
        health=health,
    )


def _started(address: str, transport: Transport | None, then: Callable[[str], object] | None) -> None:
    if transport is not None:
        transport.bind_address(address)
    if then is not None:
        then(address)
