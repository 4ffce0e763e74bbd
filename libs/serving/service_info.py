"""Who a process is, as it advertises in `ServiceInfo`: its incarnation, software version, model
identity, role and what it can do. Every service's `ServiceInfo` is built from here."""

from __future__ import annotations

import uuid
from collections.abc import Iterable

from libs.contract import version
from libs.contract.epd.v1 import service_info_pb2
from libs.model.types import EmbeddingSpec
from libs.rpc.admission import CAPABILITY as ADMISSION_PRIORITY
from libs.serving.convert import embedding_spec_to_wire
from libs.serving.settings import ModelServiceSettings

SOFTWARE_VERSION = "epd 0.1.0"
# One id per process incarnation: peers re-check us (and reload NIXL metadata) when it changes.
INSTANCE_ID = uuid.uuid4().hex


def model_identity(settings: ModelServiceSettings, weights_digest: str) -> service_info_pb2.ModelIdentity:
    return service_info_pb2.ModelIdentity(
        model_id=settings.model_id or settings.model.name, revision=settings.revision, weights_digest=weights_digest
    )


def service_info(
    role: service_info_pb2.ServiceRole.ValueType,
    model: service_info_pb2.ModelIdentity,
    specs: Iterable[EmbeddingSpec] = (),
    transports: Iterable[service_info_pb2.TransportInfo] = (),
    capabilities: Iterable[str] = (ADMISSION_PRIORITY,),
) -> service_info_pb2.ServiceInfo:
    return service_info_pb2.ServiceInfo(
        contract_version=version.current(),
        model=model,
        role=role,
        embedding_specs=[embedding_spec_to_wire(s) for s in specs],
        transports=list(transports),
        instance_id=INSTANCE_ID,
        capabilities=list(capabilities),
        software_version=SOFTWARE_VERSION,
    )
