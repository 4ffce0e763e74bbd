"""gRPC adapter of the encoder: `EncoderService` (+ leases, stats) over `EncoderCore`."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from libs.contract.epd.v1 import encoder_pb2, encoder_pb2_grpc, service_info_pb2
from libs.engine.encoder_runner import EncoderRunner
from libs.rpc.admission import Admission, deadline_of
from libs.rpc.drain import drainer
from libs.rpc.main import ServiceParts, service_main
from libs.serving.engine_loop import EngineThread
from libs.serving.identity import model_identity, service_info
from libs.serving.servicers import lease_servicer, stats_servicer
from libs.serving.settings import ModelServiceSettings
from libs.serving.transport import Transport, transfer_config
from libs.telemetry import bind_request
from services.encoder.core import EncoderCore


@dataclasses.dataclass(frozen=True)
class EncoderSettings(ModelServiceSettings):
    """Encoder: media -> embeddings held in a registered pool for prefill to read."""


class EncoderServicer(encoder_pb2_grpc.EncoderServiceServicer):
    def __init__(self, core: EncoderCore, admission: Admission) -> None:
        self._core = core
        self._admission = admission

    async def Encode(self, request: encoder_pb2.EncodeRequest, context: Any) -> encoder_pb2.EncodeResponse:
        with bind_request(request.request_id or "-"):
            async with self._admission.slot(deadline_of(context.time_remaining()), request.priority):
                return await self._core.encode(request)


async def setup(settings: EncoderSettings) -> ServiceParts:
    torch.set_num_threads(settings.torch_threads)
    runner = EncoderRunner(settings.model)
    identity = model_identity(settings, runner.weights_digest)
    transport = Transport(
        transfer_config(settings, "encoder"),
        identity,
        produce=True,
        consume=False,
    )
    engine = EngineThread("encoder")
    core = EncoderCore(runner, transport, engine, file_root=settings.file_root)
    admission = Admission("encoder", settings.max_running, settings.max_waiting)
    info = service_info(
        service_info_pb2.SERVICE_ROLE_ENCODER, identity, runner.specs.values(), transport.transport_info()
    )

    async def close() -> None:
        engine.shutdown()
        transport.close()

    return ServiceParts(
        servicers=[
            (
                encoder_pb2_grpc.add_EncoderServiceServicer_to_server,
                EncoderServicer(core, admission),
                "epd.v1.EncoderService",
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
    service_main("encoder", EncoderSettings, setup)
