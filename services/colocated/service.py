"""gRPC adapter of the colocated service: `GenerateService` (+ stats) over `ColocatedCore`."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import torch

from libs.config import ClientAuthSettings
from libs.contract.epd.v1 import generate_pb2, generate_pb2_grpc, service_info_pb2
from libs.rpc.admission import Admission, admitted
from libs.rpc.main import ServiceParts, client_facing, service_main
from libs.serving.identity import model_identity, service_info
from libs.serving.parts import model_service_parts
from libs.serving.settings import ChunkedPrefillSettings, ModelServiceSettings
from services.colocated.core import ColocatedCore


@dataclasses.dataclass(frozen=True)
class ColocatedSettings(ClientAuthSettings, ChunkedPrefillSettings, ModelServiceSettings):
    """Colocated: encode, prefill and decode in one process."""


class GenerateServicer(generate_pb2_grpc.GenerateServiceServicer):
    def __init__(self, core: ColocatedCore, admission: Admission) -> None:
        self._core = core
        self._admission = admission

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: Any
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        async with admitted(self._admission, request, context):
            async for response in self._core.generate(request):
                yield response


async def setup(settings: ColocatedSettings) -> ServiceParts:
    torch.set_num_threads(settings.torch_threads)
    core = ColocatedCore(
        settings.model,
        max_batch=settings.max_batch,
        file_root=settings.file_root,
        chunk_tokens=settings.prefill_chunk_tokens,
    )
    identity = model_identity(settings, core.runtime.weights_digest)
    admission = Admission("colocated", min(settings.max_running, settings.max_batch), settings.max_waiting)
    parts = model_service_parts(
        (
            generate_pb2_grpc.add_GenerateServiceServicer_to_server,
            GenerateServicer(core, admission),
            "epd.v1.GenerateService",
        ),
        admission=admission,
        info=service_info(service_info_pb2.SERVICE_ROLE_COLOCATED, identity, core.encoder.specs.values()),
        engine=core.engine,
        active_sequences=lambda: core.decode.active,
    )
    return client_facing(parts, settings)


def main() -> None:
    service_main("colocated", ColocatedSettings, setup)
