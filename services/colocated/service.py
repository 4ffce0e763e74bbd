"""gRPC adapter of the colocated service: `GenerateService` (+ stats) over `ColocatedCore`, on the
reference runtime."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from libs.backends import registry
from libs.backends.api import ColocatedBackend
from libs.backends.hosting.parts import backend_info, backend_parts
from libs.backends.settings import ColocatedBackendSettings
from libs.config import ClientAuthSettings
from libs.contract.epd.v1 import generate_pb2, generate_pb2_grpc, service_info_pb2
from libs.rpc.admission import Admission, admitted
from libs.rpc.main import ServiceParts, client_facing, service_main
from services.colocated.core import ColocatedCore


@dataclasses.dataclass(frozen=True)
class ColocatedSettings(ClientAuthSettings, ColocatedBackendSettings):
    """Colocated: encode, prefill and decode in one process."""


class GenerateServicer(generate_pb2_grpc.GenerateServiceServicer):
    def __init__(self, core: ColocatedCore, admission: Admission) -> None:
        self._core = core
        self._admission = admission

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: Any
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        async with admitted(self._admission, request, context) as deadline:
            async for response in self._core.generate(request, deadline):
                yield response


async def setup(settings: ColocatedSettings) -> ServiceParts:
    backend: ColocatedBackend = await registry.start("colocated", "reference", settings)
    admission = Admission("colocated", backend.max_running, settings.max_waiting)
    parts = backend_parts(
        (
            generate_pb2_grpc.add_GenerateServiceServicer_to_server,
            GenerateServicer(ColocatedCore(backend), admission),
            "epd.v1.GenerateService",
        ),
        backend,
        admission=admission,
        info=backend_info(service_info_pb2.SERVICE_ROLE_COLOCATED, settings, backend),
    )
    return client_facing(parts, settings)


def main() -> None:
    service_main("colocated", ColocatedSettings, setup)
