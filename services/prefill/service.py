"""gRPC adapter of prefill: `PrefillService` (+ leases, stats) over `PrefillCore`."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from libs.backends.api import engine_capabilities
from libs.backends.identity import PAGED_KV
from libs.backends.settings import EngineSettings
from libs.config import setting
from libs.contract.epd.v1 import prefill_pb2, prefill_pb2_grpc, service_info_pb2
from libs.rpc.admission import CAPABILITY as ADMISSION_PRIORITY
from libs.rpc.admission import Admission, admitted
from libs.rpc.main import ServiceParts, service_main
from libs.serving.compute_thread import ComputeThread
from libs.serving.identity import model_identity, service_info
from libs.serving.parts import model_service_parts
from libs.serving.settings import ChunkedPrefillSettings
from libs.serving.transport import Transport, transfer_config
from services.prefill.core import PrefillCore
from services.prefill.engine_core import EnginePrefillCore


@dataclasses.dataclass(frozen=True)
class PrefillSettings(ChunkedPrefillSettings, EngineSettings):
    """Prefill: metadata-only requests -> KV cache for decode + the first token."""

    pool_mib: int = setting(512, "registered tensor pool (embeddings read + KV published), in MiB")


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, core: PrefillCore | EnginePrefillCore, admission: Admission) -> None:
        self._core = core
        self._admission = admission

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: Any) -> prefill_pb2.PrefillResponse:
        async with admitted(self._admission, request, context) as deadline:
            return await self._core.prefill(request, deadline)


async def _vllm_setup(settings: PrefillSettings) -> ServiceParts:
    from libs.backends.vllm.prefill import VllmPrefill  # imports vLLM (~15 s): only when chosen

    engine = await VllmPrefill.start(settings)
    admission = Admission("prefill", settings.max_running, settings.max_waiting)
    servicer = PrefillServicer(EnginePrefillCore(engine), admission)
    return model_service_parts(
        (prefill_pb2_grpc.add_PrefillServiceServicer_to_server, servicer, "epd.v1.PrefillService"),
        admission=admission,
        info=service_info(
            service_info_pb2.SERVICE_ROLE_PREFILL,
            model_identity(settings, engine.weights_digest),
            engine.expected_specs(),
            capabilities=engine_capabilities("vllm", (ADMISSION_PRIORITY, PAGED_KV)),
        ),
        engine=None,
        leases=engine.leases,  # the KV blocks vLLM keeps for decode
        active_sequences=lambda: engine.active,
        on_close_async=engine.close,
        on_listening=lambda address: setattr(engine, "address", address),
        health=engine.watch_health,
    )


async def setup(settings: PrefillSettings) -> ServiceParts:
    if settings.engine == "vllm":
        return await _vllm_setup(settings)
    from libs.runtime.lm_runtime import LanguageModelRuntime
    from libs.runtime.prefill_runner import PrefillRunner
    from libs.serving.speech import speech_capabilities, transcription_spec

    torch.set_num_threads(settings.torch_threads)
    runtime = LanguageModelRuntime(settings.model)
    identity = model_identity(settings, runtime.weights_digest)
    transport = Transport(transfer_config(settings, "prefill"), identity, produce=True, consume=True)
    engine = ComputeThread("prefill")
    admission = Admission("prefill", settings.max_running, settings.max_waiting)
    runner = PrefillRunner(runtime, chunk_tokens=settings.prefill_chunk_tokens)
    core = PrefillCore(runner, transport, engine)
    servicer = PrefillServicer(core, admission)
    info = service_info(
        service_info_pb2.SERVICE_ROLE_PREFILL,
        identity,
        runtime.expected_specs(),
        transport.transport_info(),
        capabilities=(ADMISSION_PRIORITY, *speech_capabilities(runtime.adapter)),
    )
    if (spec := transcription_spec(runtime.adapter)) is not None:
        info.transcription.CopyFrom(spec)
    return model_service_parts(
        (prefill_pb2_grpc.add_PrefillServiceServicer_to_server, servicer, "epd.v1.PrefillService"),
        admission=admission,
        info=info,
        engine=engine,
        transport=transport,
    )


def main() -> None:
    service_main("prefill", PrefillSettings, setup)
