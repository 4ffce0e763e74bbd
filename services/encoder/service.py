"""gRPC adapter of the encoder: `EncoderService` (+ leases, stats) over `EncoderCore`, on the
reference runtime or on vLLM encoder-only (`--engine vllm`: libs/backends/vllm/encoder.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

from libs.backends import registry
from libs.backends.api import EncoderBackend
from libs.backends.hosting.parts import backend_info, backend_parts
from libs.backends.settings import EncoderBackendSettings
from libs.config import setting
from libs.contract.epd.v1 import encoder_pb2, encoder_pb2_grpc, service_info_pb2
from libs.rpc.admission import Admission, admitted
from libs.rpc.main import ServiceParts, service_main
from services.encoder.core import EncoderCore


@dataclasses.dataclass(frozen=True)
class EncoderSettings(EncoderBackendSettings):
    """Encoder: media -> embeddings held in a registered pool for prefill to read."""

    cached_max_running: int = setting(
        8, "cache-only jobs (the router's short-circuit) running at once, in their own lane apart from compute"
    )


class EncoderServicer(encoder_pb2_grpc.EncoderServiceServicer):
    def __init__(self, core: EncoderCore, compute: Admission, cached: Admission) -> None:
        self._core = core
        self._compute = compute
        self._cached = cached  # cache-only jobs never wait behind the tower

    async def Encode(self, request: encoder_pb2.EncodeRequest, context: Any) -> encoder_pb2.EncodeResponse:
        cached_only = request.cache_policy == encoder_pb2.CACHE_POLICY_CACHED_ONLY
        async with admitted(self._cached if cached_only else self._compute, request, context) as deadline:
            return await self._core.encode(request, deadline)


async def setup(settings: EncoderSettings) -> ServiceParts:
    backend: EncoderBackend = await registry.start("encoder", settings.engine, settings)
    admission = Admission("encoder", backend.max_running, settings.max_waiting)
    cached_lane = Admission("encoder.cached", settings.cached_max_running, settings.max_waiting)
    servicer = EncoderServicer(EncoderCore(backend), admission, cached_lane)
    return backend_parts(
        (encoder_pb2_grpc.add_EncoderServiceServicer_to_server, servicer, "epd.v1.EncoderService"),
        backend,
        admission=admission,
        other_lanes=(cached_lane,),
        info=backend_info(service_info_pb2.SERVICE_ROLE_ENCODER, settings, backend),
    )


def main() -> None:
    service_main("encoder", EncoderSettings, setup)
