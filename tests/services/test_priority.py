"""Priority ordering under real load: a colocated service with every running slot taken by
streaming requests queues four more; as one slot cycles, they are served highest priority first,
equal priorities in arrival order. The fillers hold their slots until cancelled, on any host: their
streams wait before their decode at a gate that never opens (tests/support/gated.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from libs.client.generate import build_request, open_channel
from libs.contract.epd.v1 import generate_pb2_grpc, sampling_pb2, stats_pb2, stats_pb2_grpc
from libs.launch.process import ServiceProcess
from tests.support.stacks import pool_stats, wait_for

pytestmark = pytest.mark.integration  # one colocated service of its own

SLOTS = 8  # the colocated service admits min(max_running 16, max_batch 8) requests at once
ARRIVALS = [("low-1", -10), ("low-2", -10), ("high", 50), ("default", 0)]
HELD = "filler-"  # request ids whose streams wait at the gate, after prefill's token


async def _served_order(address: str) -> list[str]:
    async with open_channel(address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        stats = stats_pb2_grpc.StatsServiceStub(channel)

        async def in_flight() -> int:
            return (await stats.GetStats(stats_pb2.GetStatsRequest(), timeout=10)).requests_in_flight

        async def until_in_flight(n: int) -> None:
            for _ in range(3000):  # bounded: 30 s
                if await in_flight() == n:
                    return
                await asyncio.sleep(0.01)
            raise AssertionError(f"never {n} requests in flight (now {await in_flight()})")

        await until_in_flight(0)
        held = sampling_pb2.SamplingParams(max_tokens=16)  # ends only once its gate opens: never
        fillers = [
            stub.Generate(build_request("Count forever.", sampling=held, request_id=f"{HELD}{i}"), timeout=120)
            for i in range(SLOTS)
        ]
        try:
            for call in fillers:
                await call.read()  # prefill's token; then it waits at the gate, holding its slot
            order: list[str] = []

            async def queued(name: str, priority: int) -> None:
                request = build_request(
                    "Say something.", sampling=sampling_pb2.SamplingParams(max_tokens=4), request_id=f"prio-{name}"
                )
                request.priority = priority
                async for response in stub.Generate(request, timeout=120):
                    if response.chunk.token_ids and name not in order:
                        order.append(name)  # its first token: it was admitted

            waiting = []
            for name, priority in ARRIVALS:  # one at a time, so their arrival order is certain
                waiting.append(asyncio.ensure_future(queued(name, priority)))
                await until_in_flight(SLOTS + len(waiting))
            assert order == []  # all four wait
            fillers[0].cancel()  # one slot frees, and cycles through the waiting requests
            await asyncio.wait_for(asyncio.gather(*waiting), 120)
            return order
        finally:
            for call in fillers:
                call.cancel()


@pytest.mark.timeout(240)
def test_waiting_requests_are_served_by_priority_then_arrival(model_path: Path, tmp_path: Path) -> None:
    gate = ["--streams", HELD, str(tmp_path / "never"), "services.colocated"]  # tests/support/gated.py
    service = ServiceProcess(
        "colocated", "tests.support.gated", [*gate, "--model", str(model_path)], log_path=tmp_path / "colocated.log"
    )
    service.start()
    try:
        service.wait_ready(120)
        assert asyncio.run(_served_order(service.address)) == ["high", "default", "low-1", "low-2"]
        wait_for(lambda: pool_stats(service.address).requests_in_flight == 0, 30, "every slot given back")
    finally:
        assert service.stop() == 0, service.log_tail()
