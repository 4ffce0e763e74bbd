"""The `ServiceParts` of a model service: its own servicer over a backend, plus what every model
service has (stats, leases when it produces tensors, drain on shutdown, the backend's clean-up),
and the `ServiceInfo` it advertises."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from libs.backends.api import Backend, EngineLeases
from libs.backends.hosting.servicers import engine_lease_servicer, lease_servicer, stats_servicer
from libs.contract.epd.v1 import service_info_pb2
from libs.contract.validation import RAW_PROMPT_CAPABILITY, SAMPLING_CAPABILITY
from libs.rpc.admission import CAPABILITY as ADMISSION_PRIORITY
from libs.rpc.admission import Admission
from libs.rpc.drain import drainer
from libs.rpc.main import Register, ServiceParts
from libs.serving.service_info import model_identity, service_info
from libs.serving.settings import ModelServiceSettings
from libs.serving.transport import Transport


def _sampling(role: service_info_pb2.ServiceRole.ValueType) -> tuple[str, ...]:
    """Contract 1.6's sampling fields: every engine's prefill, decode and PD implement them."""
    generating = (
        service_info_pb2.SERVICE_ROLE_PREFILL,
        service_info_pb2.SERVICE_ROLE_DECODE,
        service_info_pb2.SERVICE_ROLE_PREFILL_DECODE,
    )
    prompting = (service_info_pb2.SERVICE_ROLE_PREFILL, service_info_pb2.SERVICE_ROLE_PREFILL_DECODE)
    raw = (RAW_PROMPT_CAPABILITY,) if role in prompting else ()
    return (SAMPLING_CAPABILITY, *raw) if role in generating else ()


def backend_info(
    role: service_info_pb2.ServiceRole.ValueType, settings: ModelServiceSettings, backend: Backend
) -> service_info_pb2.ServiceInfo:
    """What a service running `backend` advertises: the model, the embeddings the backend produces
    or consumes, the transport's descriptions, admission priority and the backend's capabilities
    (the transport's own are added by `backend_parts`), the requests it runs at once, and the
    backend's role-specific fields."""
    info = service_info(
        role,
        model_identity(settings, backend.weights_digest),
        backend.embedding_specs(),
        backend.transport.transport_info() if backend.transport is not None else (),
        capabilities=(ADMISSION_PRIORITY, *_sampling(role), *backend.capabilities()),
    )
    info.max_running_requests = backend.max_running  # the service's admission runs this many at once
    backend.extend_info(info)
    return info


def backend_parts(
    servicer: tuple[Register, Any, str],
    backend: Backend,
    *,
    admission: Admission,
    info: service_info_pb2.ServiceInfo,
    other_lanes: Sequence[Admission] = (),
) -> ServiceParts:
    """`backend.transport`'s leases, or the tensors the engine holds (`backend.leases`), are served
    by `LeaseService` and counted in the stats and the drain."""
    transport, leases = backend.transport, backend.leases
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
        stats_servicer(transport, lambda: sum(a.running + a.waiting for a in lanes), lambda: backend.active, pool)
    )
    return ServiceParts(
        servicers=servicers,
        info=lambda: info,
        close=backend.close,
        drain=drainer(*lanes, held_leases=_held(transport, leases)),
        on_started=backend.serving_at,
        health=backend.watch_health,
        fatal=backend.watch_fatal,
    )


def _held(transport: Transport | None, leases: EngineLeases | None) -> Callable[[], int]:
    if transport is not None:
        return transport.held_leases
    if leases is not None:
        return leases.held
    return lambda: 0
