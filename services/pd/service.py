"""gRPC adapter of the PD service: `PrefillDecodeService` (+ stats) over `PrefillDecodeCore`, on the
backend chosen with `--engine` (reference runtime or vLLM)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from libs.backends import registry
from libs.backends.api import PrefillDecodeBackend
from libs.backends.hosting.parts import backend_info, backend_parts
from libs.backends.settings import PrefillDecodeEngineSettings
from libs.contract.epd.v1 import prefill_decode_pb2, prefill_decode_pb2_grpc, service_info_pb2
from libs.rpc.admission import Admission, admitted
from libs.rpc.main import ServiceParts, service_main
from services.pd.core import PrefillDecodeCore


@dataclasses.dataclass(frozen=True)
class PrefillDecodeSettings(PrefillDecodeEngineSettings):
    """PD: metadata-only requests -> prefill and decode in one process (E+PD layout)."""


class PrefillDecodeServicer(prefill_decode_pb2_grpc.PrefillDecodeServiceServicer):
    def __init__(self, core: PrefillDecodeCore, admission: Admission) -> None:
        self._core = core
        self._admission = admission

    async def PrefillDecode(
        self, request: prefill_decode_pb2.PrefillDecodeRequest, context: Any
    ) -> AsyncIterator[prefill_decode_pb2.PrefillDecodeResponse]:
        async with admitted(self._admission, request, context) as deadline:
            async for response in self._core.generate(request, deadline):
                yield response


async def setup(settings: PrefillDecodeSettings) -> ServiceParts:
    backend: PrefillDecodeBackend = await registry.start("pd", settings.engine, settings)
    admission = Admission("pd", backend.max_running, settings.max_waiting)
    servicer = PrefillDecodeServicer(PrefillDecodeCore(backend), admission)
    return backend_parts(
        (prefill_decode_pb2_grpc.add_PrefillDecodeServiceServicer_to_server, servicer, "epd.v1.PrefillDecodeService"),
        backend,
        admission=admission,
        info=backend_info(service_info_pb2.SERVICE_ROLE_PREFILL_DECODE, settings, backend),
    )


def main() -> None:
    service_main("pd", PrefillDecodeSettings, setup)
