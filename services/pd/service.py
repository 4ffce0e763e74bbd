"""gRPC adapter of the PD service: `PrefillDecodeService` (+ stats) over `PrefillDecodeCore`."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import torch

from libs.contract.epd.v1 import prefill_decode_pb2, prefill_decode_pb2_grpc, service_info_pb2
from libs.engine.decode_runner import DecodeRunner
from libs.engine.lm_runtime import LanguageModelRuntime
from libs.engine.prefill_runner import PrefillRunner
from libs.rpc.admission import Admission, admitted
from libs.rpc.main import ServiceParts, service_main
from libs.serving.engine_loop import DecodeLoop, EngineThread
from libs.serving.identity import model_identity, service_info
from libs.serving.parts import model_service_parts
from libs.serving.settings import ModelServiceSettings
from libs.serving.transport import Transport, transfer_config
from services.pd.core import PrefillDecodeCore


@dataclasses.dataclass(frozen=True)
class PrefillDecodeSettings(ModelServiceSettings):
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
    torch.set_num_threads(settings.torch_threads)
    runtime = LanguageModelRuntime(settings.model)
    identity = model_identity(settings, runtime.weights_digest)
    transport = Transport(transfer_config(settings, "pd"), identity, produce=False, consume=True)
    engine = EngineThread("pd")
    loop = DecodeLoop(DecodeRunner(runtime, max_batch=settings.max_batch), engine)
    admission = Admission("pd", min(settings.max_running, settings.max_batch), settings.max_waiting)
    servicer = PrefillDecodeServicer(PrefillDecodeCore(PrefillRunner(runtime), loop, transport, engine), admission)
    return model_service_parts(
        (prefill_decode_pb2_grpc.add_PrefillDecodeServiceServicer_to_server, servicer, "epd.v1.PrefillDecodeService"),
        admission=admission,
        info=service_info(
            service_info_pb2.SERVICE_ROLE_PREFILL_DECODE, identity, runtime.expected_specs(), transport.transport_info()
        ),
        engine=engine,
        transport=transport,
        active_sequences=lambda: loop.active,
    )


def main() -> None:
    service_main("pd", PrefillDecodeSettings, setup)
