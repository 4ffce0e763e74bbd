"""gRPC adapter of prefill: `PrefillService` (+ leases, stats) over `PrefillCore`, on the backend
chosen with `--engine` (reference runtime or vLLM)."""

from __future__ import annotations

import dataclasses
from typing import Any

from libs.backends import registry
from libs.backends.api import PrefillBackend
from libs.backends.hosting.parts import backend_info, backend_parts
from libs.backends.settings import ChunkedEngineSettings
from libs.config import setting
from libs.contract.epd.v1 import prefill_pb2, prefill_pb2_grpc, service_info_pb2
from libs.rpc.admission import Admission, admitted
from libs.rpc.main import ServiceParts, service_main
from services.prefill.core import PrefillCore


@dataclasses.dataclass(frozen=True)
class PrefillSettings(ChunkedEngineSettings):
    """Prefill: metadata-only requests -> KV cache for decode + the first token."""

    pool_mib: int = setting(512, "registered tensor pool (embeddings read + KV published), in MiB")


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, core: PrefillCore, admission: Admission) -> None:
        self._core = core
        self._admission = admission

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: Any) -> prefill_pb2.PrefillResponse:
        async with admitted(self._admission, request, context) as deadline:
            return await self._core.prefill(request, deadline)


async def setup(settings: PrefillSettings) -> ServiceParts:
    backend: PrefillBackend = await registry.start("prefill", settings.engine, settings)
    admission = Admission("prefill", backend.max_running, settings.max_waiting)
    servicer = PrefillServicer(PrefillCore(backend), admission)
    return backend_parts(
        (prefill_pb2_grpc.add_PrefillServiceServicer_to_server, servicer, "epd.v1.PrefillService"),
        backend,
        admission=admission,
        info=backend_info(service_info_pb2.SERVICE_ROLE_PREFILL, settings, backend),
    )


def main() -> None:
    service_main("prefill", PrefillSettings, setup)
