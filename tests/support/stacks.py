"""Helpers for tests that drive real stacks: the golden mixes by name, concurrent requests,
`GetStats` of one service, and polling until a condition holds or every pool is empty."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from libs.client.generate import GenerationResult, generate, open_channel
from libs.contract.epd.v1 import generate_pb2
from libs.launch.stack import Stack
from tests.support.golden import ALL_MODALITIES
from tests.support.mixes import mixes

MIXES = {mix.name: mix for mix in mixes(ALL_MODALITIES)}


def wait_for(condition: Callable[[], object], timeout_s: float, what: str, poll_s: float = 0.02) -> None:
    """Poll `condition` until it is truthy; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(poll_s)


def run_requests(address: str, requests: list[generate_pb2.GenerateRequest], **kw: Any) -> list[GenerationResult]:
    """Send requests concurrently over one channel; results in request order."""

    async def go() -> list[GenerationResult]:
        async with open_channel(address) as channel:
            return list(await asyncio.gather(*(generate(channel, r, **kw) for r in requests)))

    return asyncio.run(go())


def pool_stats(address: str) -> Any:
    """`GetStats` of one service."""
    import grpc

    from libs.contract.epd.v1 import stats_pb2, stats_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        return stats_pb2_grpc.StatsServiceStub(channel).GetStats(stats_pb2.GetStatsRequest(), timeout=5)


def wait_pools_empty(stack: Stack, timeout_s: float = 15.0, *, allow_quarantine: bool = False) -> dict[str, Any]:
    """Poll every pool-holding service until no slot, lease or request is held; returns the stats.
    `allow_quarantine` tolerates slots quarantined after a READ timed out (a peer died mid-read):
    they return to the pool only after the quarantine period, by design."""
    names = [n for n in stack.processes if n != "router" and stack.processes[n].alive()]
    deadline = time.monotonic() + timeout_s
    while True:
        stats = {name: pool_stats(stack.processes[name].address) for name in names}
        busy = {
            name: s
            for name, s in stats.items()
            if s.pool.slots_in_use
            or (s.pool.quarantined_slots and not allow_quarantine)
            or s.pool.active_leases
            or s.requests_in_flight
            or s.active_sequences
        }
        if not busy or time.monotonic() > deadline:
            assert not busy, f"pools not empty after {timeout_s} s: {busy}"
            return stats
        time.sleep(0.1)


def layout_slug(layout: str) -> str:
    """A request-id part per layout, distinct for each ("e/p/d" -> "e-p-d", "e+pd" -> "e-pd"):
    every session stack's spans reach one receiver, and tests tell them apart by request id."""
    return layout.replace("/", "-").replace("+", "-")
