"""gRPC adapter of decode: `DecodeService` (+ stats) over `DecodeCore`, on the backend chosen with
`--engine` (reference runtime or vLLM)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from libs.backends import registry
from libs.backends.api import DecodeBackend
from libs.backends.hosting.parts import backend_info, backend_parts
from libs.backends.settings import EngineSettings
from libs.config import setting
from libs.contract.epd.v1 import decode_pb2, decode_pb2_grpc, service_info_pb2
from libs.rpc.admission import Admission, admitted
from libs.rpc.main import ServiceParts, service_main
from services.decode.core import DecodeCore


@dataclasses.dataclass(frozen=True)
class DecodeSettings(EngineSettings):
    """Decode: KV caches from prefill -> streamed tokens, many sequences per batched step."""

    pool_mib: int = setting(512, "registered tensor pool for KV reads, in MiB")
    # More than the other services' 8: a decode slot is held for a whole generation, so with 8 a
    # short request waited behind 8 long ones for their end. 32 sequences of the
    # reference engine's KV fit its memory at the models' context; vLLM schedules its own blocks.
    max_running: int = setting(32, "requests decoding at once (within --max-batch): what the router admits to decode")
    max_batch: int = setting(32, "sequences decoded together in one step")


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self, core: DecodeCore, admission: Admission) -> None:
        self._core = core
        self._admission = admission

    async def Decode(self, request: decode_pb2.DecodeRequest, context: Any) -> AsyncIterator[decode_pb2.DecodeResponse]:
        async with admitted(self._admission, request, context) as deadline:
            async for response in self._core.decode(request, deadline):
                yield response


async def setup(settings: DecodeSettings) -> ServiceParts:
    backend: DecodeBackend = await registry.start("decode", settings.engine, settings)
    admission = Admission("decode", backend.max_running, settings.max_waiting)
    servicer = DecodeServicer(DecodeCore(backend), admission)
    return backend_parts(
        (decode_pb2_grpc.add_DecodeServiceServicer_to_server, servicer, "epd.v1.DecodeService"),
        backend,
        admission=admission,
        info=backend_info(service_info_pb2.SERVICE_ROLE_DECODE, settings, backend),
    )


def main() -> None:
    service_main("decode", DecodeSettings, setup)
