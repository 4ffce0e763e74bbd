"""gRPC adapter of prefill: `PrefillService` (+ leases, stats) over `PrefillCore`."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from libs.config import setting
from libs.contract.epd.v1 import prefill_pb2, prefill_pb2_grpc, service_info_pb2
from libs.engine.lm_runtime import LanguageModelRuntime
from libs.engine.prefill_runner import PrefillRunner
from libs.rpc.admission import Admission, deadline_of
from libs.rpc.drain import drainer
from libs.rpc.main import ServiceParts, service_main
from libs.serving.engine_loop import EngineThread
from libs.serving.identity import model_identity, service_info
from libs.serving.servicers import lease_servicer, stats_servicer
from libs.serving.settings import ModelServiceSettings
from libs.serving.transport import Transport, transfer_config
from libs.telemetry import bind_request
from services.prefill.core import PrefillCore


@dataclasses.dataclass(frozen=True)
class PrefillSettings(ModelServiceSettings):
    """Prefill: metadata-only requests -> KV cache for decode + the first token."""

    pool_mib: int = setting(512, "registered tensor pool (embeddings read + KV published), in MiB")


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, core: PrefillCore, admission: Admission) -> None:
        self._core = core
        self._admission = admission

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: Any) -> prefill_pb2.PrefillResponse:
        deadline = deadline_of(context.time_remaining())
        with bind_request(request.request_id or "-"):
            async with self._admission.slot(deadline, request.priority):
                return await self._core.prefill(request, deadline)


async def setup(settings: PrefillSettings) -> ServiceParts:
    torch.set_num_threads(settings.torch_threads)
    runtime = LanguageModelRuntime(settings.model)
    identity = model_identity(settings, runtime.weights_digest)
    transport = Transport(
        transfer_config(settings, "prefill"),
        identity,
        produce=True,
        consume=True,
    )
    engine = EngineThread("prefill")
    core = PrefillCore(PrefillRunner(runtime), transport, engine)
    admission = Admission("prefill", settings.max_running, settings.max_waiting)
    info = service_info(
        service_info_pb2.SERVICE_ROLE_PREFILL, identity, runtime.expected_specs(), transport.transport_info()
    )

    async def close() -> None:
        engine.shutdown()
        transport.close()

    return ServiceParts(
        servicers=[
            (
                prefill_pb2_grpc.add_PrefillServiceServicer_to_server,
                PrefillServicer(core, admission),
                "epd.v1.PrefillService",
            ),
            lease_servicer(transport),
            stats_servicer(transport, lambda: admission.running + admission.waiting),
        ],
        info=lambda: info,
        close=close,
        drain=drainer(admission, transport.held_leases),
        on_started=transport.bind_address,
    )


def main() -> None:
    service_main("prefill", PrefillSettings, setup)
