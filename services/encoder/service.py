"""gRPC adapter of the encoder: `EncoderService` (+ leases, stats) over `EncoderCore`."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from libs.contract.epd.v1 import encoder_pb2, encoder_pb2_grpc, service_info_pb2
from libs.engine.encoder_runner import EncoderRunner
from libs.rpc.admission import Admission, admitted
from libs.rpc.main import ServiceParts, service_main
from libs.serving.engine_loop import EngineThread
from libs.serving.identity import model_identity, service_info
from libs.serving.parts import model_service_parts
from libs.serving.settings import ModelServiceSettings
from libs.serving.transport import Transport, transfer_config
from services.encoder.core import EncoderCore


@dataclasses.dataclass(frozen=True)
class EncoderSettings(ModelServiceSettings):
    """Encoder: media -> embeddings held in a registered pool for prefill to read."""


class EncoderServicer(encoder_pb2_grpc.EncoderServiceServicer):
    def __init__(self, core: EncoderCore, admission: Admission) -> None:
        self._core = core
        self._admission = admission

    async def Encode(self, request: encoder_pb2.EncodeRequest, context: Any) -> encoder_pb2.EncodeResponse:
        async with admitted(self._admission, request, context):
            return await self._core.encode(request)


async def setup(settings: EncoderSettings) -> ServiceParts:
    torch.set_num_threads(settings.torch_threads)
    runner = EncoderRunner(settings.model)
    identity = model_identity(settings, runner.weights_digest)
    transport = Transport(transfer_config(settings, "encoder"), identity, produce=True, consume=False)
    engine = EngineThread("encoder")
    admission = Admission("encoder", settings.max_running, settings.max_waiting)
    servicer = EncoderServicer(EncoderCore(runner, transport, engine, file_root=settings.file_root), admission)
    return model_service_parts(
        (encoder_pb2_grpc.add_EncoderServiceServicer_to_server, servicer, "epd.v1.EncoderService"),
        admission=admission,
        info=service_info(
            service_info_pb2.SERVICE_ROLE_ENCODER, identity, runner.specs.values(), transport.transport_info()
        ),
        engine=engine,
        transport=transport,
    )


def main() -> None:
    service_main("encoder", EncoderSettings, setup)
