"""Calls fired into a server's stop, the cause of the rolling-upgrade failures on loaded CI hosts.

When a draining service finally stops its gRPC server, grpc core cancels the calls that reached it
but had not been handed to a handler, and those that crossed its shutdown notice, with a bare
CANCELLED. Those calls say nothing about the request: the client retries them like UNAVAILABLE
(libs/rpc/retry.py) and the replacement server answers. Real processes: the server is
`tests/rpc/slow_generate.py` under the same `service_main` / `EpdServer` / `Admission` / `drainer`
as every EPD service, stopped by SIGTERM and replaced on the same port.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from pathlib import Path

import grpc
import pytest

from libs.client.generate import GenerationResult, build_request, generate, open_channel
from libs.launch.process import ServiceProcess, free_port

FIRE_EVERY_S = 0.005  # an open-loop load: a new call every 5 ms, whatever the server does
MAX_CALLS = 2000


def _server(port: int, log: Path) -> ServiceProcess:
    process = ServiceProcess("slow", "tests.rpc.slow_generate", ["--port", str(port), "--hold-s", "0.3"], log)
    process.start()
    process.wait_ready(60)
    return process


def _restart_under_load(tmp_path: Path, trial: int) -> tuple[list[GenerationResult | str], int | None]:
    """Fire calls at a server while it is stopped (SIGTERM) and replaced on its port; every outcome,
    and the old process's exit status."""
    port = free_port()
    old = _server(port, tmp_path / f"old-{trial}.log")
    new: ServiceProcess | None = None
    status: list[int | None] = []

    def restart(loop: asyncio.AbstractEventLoop, replaced: asyncio.Event) -> None:
        nonlocal new
        try:
            threading.Event().wait(0.4)  # calls in flight first
            status.append(old.stop(timeout_s=30))
            new = _server(port, tmp_path / f"new-{trial}.log")
        finally:
            loop.call_soon_threadsafe(replaced.set)

    async def load() -> list[GenerationResult | str]:
        replaced = asyncio.Event()

        async def one(i: int) -> GenerationResult | str:
            request = build_request("hi", request_id=f"t{trial}-{i}")
            try:
                return await generate(channel, request, timeout_s=60, retry_unavailable=True)
            except grpc.aio.AioRpcError as exc:
                return f"{exc.code().name}: {exc.details()}"

        async with open_channel(f"127.0.0.1:{port}") as channel:
            thread = threading.Thread(target=restart, args=(asyncio.get_running_loop(), replaced))
            thread.start()
            calls = []
            while not replaced.is_set() and len(calls) < MAX_CALLS:
                calls.append(asyncio.ensure_future(one(len(calls))))
                await asyncio.sleep(FIRE_EVERY_S)
            outcomes = list(await asyncio.gather(*calls))
            await asyncio.to_thread(thread.join, 60)
        return outcomes

    try:
        outcomes = asyncio.run(load())
    finally:
        for process in (old, new):
            if process is not None:
                process.stop()
    return outcomes, status[0] if status else None


@pytest.mark.timeout(240)
def test_calls_fired_into_a_stopping_server_are_retried_not_failed(tmp_path: Path) -> None:
    retried: Counter[str] = Counter()
    for trial in range(6):  # until a call met the stop itself (nearly every trial), bounded
        outcomes, status = _restart_under_load(tmp_path, trial)
        assert status == 0
        failed = [o for o in outcomes if isinstance(o, str)]
        assert not failed, (len(failed), len(outcomes), failed[:3])
        assert all(o.token_ids == [1] for o in outcomes if not isinstance(o, str))
        retried.update(code for o in outcomes if not isinstance(o, str) for code in o.retried_codes)
        if retried["CANCELLED"]:
            break
    print(f"retried: {dict(retried)} in {trial + 1} trial(s)")
    # The race was exercised: some calls were cancelled by the stopping server (and then succeeded).
    assert retried["CANCELLED"] > 0, retried
    assert retried["UNAVAILABLE"] > 0, retried  # and some were refused while it drained
