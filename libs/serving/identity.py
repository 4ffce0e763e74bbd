"""What a model-serving process advertises in `ServiceInfo`."""

from __future__ import annotations

from collections.abc import Iterable

from libs.contract import version
from libs.contract.epd.v1 import service_info_pb2
from libs.rpc.admission import CAPABILITY as ADMISSION_PRIORITY
from libs.rpc.identity import INSTANCE_ID, SOFTWARE_VERSION
from libs.runtime.types import EmbeddingSpec
from libs.serving.convert import embedding_spec_to_wire
from libs.serving.settings import ModelServiceSettings


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
