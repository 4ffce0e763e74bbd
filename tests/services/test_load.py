"""E/P/D with two encoders under 64 concurrent mixed requests: none lost, every one equal to the
model's own generate(), and every pool back to empty afterwards; and a burst the decode cannot take
at once waits at the router, before prefill."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from libs.contract.epd.v1 import service_info_pb2, service_info_pb2_grpc
from libs.launch.process import ServiceProcess
from libs.launch.stack import Stack
from tests.support.golden import request_for
from tests.support.interposer import Interposer
from tests.support.stacks import MIXES, pool_stats, run_requests, wait_for, wait_pools_empty

pytestmark = pytest.mark.stack


@pytest.mark.timeout(600)
def test_64_mixed_requests_in_flight(stacks: Callable[[str], Stack], expected: dict[str, list[int]]) -> None:
    stack = stacks("e/p/d")
    names = sorted(MIXES)
    plan = [names[i % len(names)] for i in range(64)]
    requests = [request_for(MIXES[name], request_id=f"load-{i}") for i, name in enumerate(plan)]
    before = {name: pool_stats(p.address).pool for name, p in stack.processes.items() if name.startswith("encoder-")}
    results = run_requests(stack.address, requests, timeout_s=300)
    assert len(results) == 64
    assert [r.request_id for r in results] == [f"load-{i}" for i in range(64)]
    wrong = {i: (plan[i], r.token_ids) for i, r in enumerate(results) if r.token_ids != expected[plan[i]]}
    assert not wrong
    stats = wait_pools_empty(stack)
    # Both encoders took work (least outstanding work spreads it) and every lease was acked, none
    # released unread or expired. Requests repeating a conversation's first message that an earlier
    # one left in the prefill's cache send its media as held (contract 1.9): not encoded again, so
    # there may be fewer leases than media items, never more.
    acked = {name: stats[name].pool.acked_leases - was.acked_leases for name, was in before.items()}
    assert all(n > 0 for n in acked.values()), acked
    assert sum(acked.values()) <= sum(len(MIXES[n].media) for n in plan)
    for name, was in before.items():
        now = stats[name].pool
        assert (now.released_leases, now.expired_leases) == (was.released_leases, was.expired_leases), name
    # Every request that went on past its first token had its KV read and acked by decode.
    assert stats["prefill"].pool.acked_leases >= sum(1 for r in results if len(r.token_ids) > 1)


@pytest.mark.timeout(300)
def test_the_router_starts_no_prefill_its_decodes_cannot_take(
    stacks: Callable[[str], Stack], expected: dict[str, list[int]], tmp_path: Path
) -> None:
    """A router of our own, with its default `--decode-in-flight`, over the session stack's prefill
    and decode, each behind an interposer: it reads the decode's bound from its ServiceInfo
    (contract 1.7: `--max-running` within its batch, 32 by default), so while every Decode call is
    held, a burst of 4 more requests than that has at most the bound between the start of prefill
    and the end of decode; once decode runs, every request ends with generate()'s tokens."""
    stack = stacks("e/p/d")
    bound = _advertised(stack.processes["decode"].address)
    assert bound == 32  # the decode's defaults: --max-running 32, --max-batch 32
    decode = Interposer(stack.processes["decode"].address)
    prefill = Interposer(stack.processes["prefill"].address)
    opened = asyncio.Event()  # set on the decode interposer's loop
    held: list[str] = []
    started: list[str] = []
    between: list[int] = []  # at each Prefill call: requests past prefill's start, decode not ended

    async def hold(request: Any) -> None:
        held.append(request.request_id)
        await opened.wait()

    async def open_gate() -> None:
        opened.set()

    async def count(request: Any) -> None:
        started.append(request.request_id)
        with decode.changed:
            ended = sum(1 for request_id in started if decode.outcomes.get(request_id))
        between.append(len(started) - ended)

    decode.hooks["Decode"] = hold
    prefill.hooks["Prefill"] = count
    decode.start()
    prefill.start()
    encoders = ",".join(p.address for n, p in stack.processes.items() if n.startswith("encoder-"))
    args = ["--encoders", encoders, "--prefill", prefill.address, "--decode", decode.address]
    router = ServiceProcess("router", "services.router", args, log_path=tmp_path / "router.log")
    router.start()
    try:
        address = router.wait_ready(60)
        burst_size = bound + 4
        requests = [request_for(MIXES["text"], request_id=f"burst-{i}") for i in range(burst_size)]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            burst = pool.submit(run_requests, address, requests, timeout_s=240)
            wait_for(lambda: len(held) >= bound, 120, "the decode's bound of Decode calls held")
            decode.run(open_gate())
            results = burst.result(240)
        assert [r.token_ids for r in results] == [expected["text"]] * burst_size
        assert len(between) == burst_size and max(between) <= bound, between
    finally:
        decode.run(open_gate())
        assert router.stop() == 0
        decode.stop()
        prefill.stop()


def _advertised(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        reply = service_info_pb2_grpc.ServiceInfoServiceStub(channel).GetServiceInfo(
            service_info_pb2.GetServiceInfoRequest(), timeout=10
        )
    return int(reply.info.max_running_requests)
