"""A minimal service for stop-race tests, run as its own process (`python -m tests.support.slow_generate`)
through the same `service_main`, `EpdServer`, `Admission` and `drainer` as every EPD service: its
`Generate` holds an admission slot for `--hold-s` (with `--hold-until-drain`, until the service's
drain has begun, then `--hold-s`; with `--hold-until FILE`, a request whose id starts with
`--hold-prefix` waits until FILE exists first) and answers one token. `GetStats` counts the calls admitted
(running or waiting): what a test waits on before it signals the service."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from libs.config import CommonSettings, setting
from libs.contract import version
from libs.contract.epd.v1 import (
    generate_pb2,
    generate_pb2_grpc,
    generation_pb2,
    service_info_pb2,
    stats_pb2,
    stats_pb2_grpc,
)
from libs.rpc.admission import Admission, admitted
from libs.rpc.drain import drainer
from libs.rpc.main import ServiceParts, service_main


@dataclasses.dataclass(frozen=True)
class SlowSettings(CommonSettings):
    hold_s: float = setting(0.3, "seconds each Generate holds its slot")
    grace_s: float = setting(3.0, "drain grace period")
    hold_until_drain: bool = setting(False, "each Generate holds its slot until the drain begins, then hold_s")
    hold_until: str = setting("", "a file: a Generate of hold_prefix holds its slot until it exists, then hold_s")
    hold_prefix: str = setting("held", "the request ids hold_until holds")


class SlowGenerate(generate_pb2_grpc.GenerateServiceServicer):
    def __init__(
        self,
        admission: Admission,
        hold_s: float,
        draining: asyncio.Event | None = None,
        gate: str = "",
        gated: str = "held",
    ) -> None:
        self._admission = admission
        self._hold_s = hold_s
        self._draining = draining
        self._gate = Path(gate) if gate else None
        self._gated = gated

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: Any
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        async with admitted(self._admission, request, context):
            if self._draining is not None:
                await self._draining.wait()
            while self._gate is not None and request.request_id.startswith(self._gated) and not self._gate.exists():
                await asyncio.sleep(0.005)
            await asyncio.sleep(self._hold_s)
            yield generate_pb2.GenerateResponse(
                request_id=request.request_id,
                chunk=generation_pb2.TokenChunk(token_ids=[1], finish_reason=generation_pb2.FINISH_REASON_LENGTH),
            )


class Stats(stats_pb2_grpc.StatsServiceServicer):
    """`GetStats` as the model services answer it, without their engine (and torch): the calls
    admitted, running or waiting."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission

    async def GetStats(self, request: stats_pb2.GetStatsRequest, context: Any) -> stats_pb2.GetStatsResponse:
        return stats_pb2.GetStatsResponse(requests_in_flight=self._admission.running + self._admission.waiting)


async def until_in_flight(address: str, count: int, timeout_s: float = 60.0) -> None:
    """(In a test) until the service at `address` reports `count` calls admitted, bounded."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with grpc.aio.insecure_channel(address) as channel:
        stub = stats_pb2_grpc.StatsServiceStub(channel)
        while (await stub.GetStats(stats_pb2.GetStatsRequest(), timeout=10)).requests_in_flight < count:
            assert asyncio.get_running_loop().time() < deadline, f"{address}: never {count} calls in flight"
            await asyncio.sleep(0.01)


async def setup(settings: SlowSettings) -> ServiceParts:
    admission = Admission("slow", max_running=64, max_waiting=256)
    draining = asyncio.Event() if settings.hold_until_drain else None
    drain = drainer(admission)

    async def drain_and_release(grace_s: float) -> None:
        if draining is not None:
            draining.set()  # the held calls carry on once the drain has begun (admission closes next)
        await drain(grace_s)

    return ServiceParts(
        servicers=[
            (
                generate_pb2_grpc.add_GenerateServiceServicer_to_server,
                SlowGenerate(admission, settings.hold_s, draining, settings.hold_until, settings.hold_prefix),
                "epd.v1.GenerateService",
            ),
            (stats_pb2_grpc.add_StatsServiceServicer_to_server, Stats(admission), "epd.v1.StatsService"),
        ],
        info=lambda: service_info_pb2.ServiceInfo(
            contract_version=version.current(), role=service_info_pb2.SERVICE_ROLE_ROUTER
        ),
        drain=drain_and_release,
    )


if __name__ == "__main__":
    service_main("slow", SlowSettings, setup)
