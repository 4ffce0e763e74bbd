"""A minimal service for stop-race tests, run as its own process (`python -m tests.support.slow_generate`)
through the same `service_main`, `EpdServer`, `Admission` and `drainer` as every EPD service: its
`Generate` holds an admission slot for `--hold-s` and answers one token."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from libs.config import CommonSettings, setting
from libs.contract import version
from libs.contract.epd.v1 import generate_pb2, generate_pb2_grpc, generation_pb2, service_info_pb2
from libs.rpc.admission import Admission, admitted
from libs.rpc.drain import drainer
from libs.rpc.main import ServiceParts, service_main


@dataclasses.dataclass(frozen=True)
class SlowSettings(CommonSettings):
    hold_s: float = setting(0.3, "seconds each Generate holds its slot")
    grace_s: float = setting(3.0, "drain grace period")


class SlowGenerate(generate_pb2_grpc.GenerateServiceServicer):
    def __init__(self, admission: Admission, hold_s: float) -> None:
        self._admission = admission
        self._hold_s = hold_s

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: Any
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        async with admitted(self._admission, request, context):
            await asyncio.sleep(self._hold_s)
            yield generate_pb2.GenerateResponse(
                request_id=request.request_id,
                chunk=generation_pb2.TokenChunk(token_ids=[1], finish_reason=generation_pb2.FINISH_REASON_LENGTH),
            )


async def setup(settings: SlowSettings) -> ServiceParts:
    admission = Admission("slow", max_running=64, max_waiting=256)
    return ServiceParts(
        servicers=[
            (
                generate_pb2_grpc.add_GenerateServiceServicer_to_server,
                SlowGenerate(admission, settings.hold_s),
                "epd.v1.GenerateService",
            )
        ],
        info=lambda: service_info_pb2.ServiceInfo(
            contract_version=version.current(), role=service_info_pb2.SERVICE_ROLE_ROUTER
        ),
        drain=drainer(admission),
    )


if __name__ == "__main__":
    service_main("slow", SlowSettings, setup)
