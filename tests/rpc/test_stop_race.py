"""Calls fired into a server's stop, the cause of the rolling-upgrade failures on loaded CI hosts.

When a draining service finally stops its gRPC server, grpc core cancels the calls that reached it
but had not been handed to a handler, and those that crossed its shutdown notice, with a bare
CANCELLED. Those calls say nothing about the request: the client retries them like UNAVAILABLE
(libs/rpc/retry.py) and the replacement server answers. Real processes: the server is
`tests/support/slow_generate.py` under the same `service_main` / `EpdServer` / `Admission` / `drainer`
as every EPD service, stopped by SIGTERM and replaced on the same port. The stopped server's event
loop is starved for a moment before its server stops (`tests/support/gated.py --stop`), as a loaded
host does now and then: the calls that arrive meanwhile are the ones grpc core cancels. Each moment
of the stop lasts until the test has fired its calls into it (gates the test opens: the calls held
until the drain is under way, the starvation until calls were sent into it), so the race happens on
every run, on a fast host as on a slow one.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from libs.client.generate import GenerationResult, build_request, generate, open_channel
from libs.contract.epd.v1 import stats_pb2, stats_pb2_grpc
from libs.launch.process import ServiceProcess, free_port

pytestmark = pytest.mark.integration

FIRE_EVERY_S = 0.005  # an open-loop load: a new call every 5 ms, whatever the server does
MAX_CALLS = 2000
# Calls unanswered at once, at most: below what the replacement admits (64 running + 256 waiting),
# which receives every call still waiting when it comes up. Past that it answers RESOURCE_EXHAUSTED,
# rightly: on a loaded host the replacement's start-up took long enough for 5 ms arrivals to pile up.
MAX_IN_FLIGHT = 256
# Calls fired into each moment of the stop (its drain, its starved event loop) before the test lets
# the server go on: each moment lasts until they were sent, however fast or slow the host (fired
# even at MAX_IN_FLIGHT: 2 x 20 more stay below what the replacement admits).
INTO_EACH = 20


def _server(port: int, log: Path, hold: Path | None = None, starve: Path | None = None) -> ServiceProcess:
    """The service on `port`: its calls take 0.3 s, a call "held..." until the file `hold` exists;
    its event loop starved after the drain until the file `starve` exists (tests/support/gated.py --stop)."""
    command = ["tests.support.slow_generate", "--port", str(port), "--hold-s", "0.3"]
    if hold is not None:
        # Its drain lasts as long as the test holds that call, bounded by 0.9 of the grace; calls
        # its starved loop took but never handled are cancelled once the rest of the grace is over.
        command += ["--hold-until", str(hold), "--hold-prefix", "held", "--grace-s", "10"]
    if starve is not None:
        command = ["tests.support.gated", "--stop", str(starve), *command]
    process = ServiceProcess("slow", command[0], command[1:], log)
    process.start()
    process.wait_ready(60)
    return process


def _until(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never {what}"
        time.sleep(0.005)


def _in_flight(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        reply = stats_pb2_grpc.StatsServiceStub(channel).GetStats(stats_pb2.GetStatsRequest(), timeout=10)
    return int(reply.requests_in_flight)


def _draining(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return bool(reply.status == health_pb2.HealthCheckResponse.NOT_SERVING)


def _restart_under_load(tmp_path: Path, trial: int) -> tuple[list[GenerationResult | str], int | None]:
    """Fire calls at a server while it is stopped (SIGTERM) and replaced on its port; every outcome,
    and the old process's exit status. The stop waits for the load at each step: a call admitted
    (held) before the signal, calls fired into the drain (refused), calls fired into the starved
    loop (cancelled by the server's stop)."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    hold, starve = tmp_path / f"hold-{trial}", tmp_path / f"starve-{trial}"
    old = _server(port, tmp_path / f"old-{trial}.log", hold=hold, starve=starve)
    new: ServiceProcess | None = None
    status: list[int | None] = []
    fired: list[int] = []  # calls fired so far (the load's count, read by the restart thread)
    owed: queue.SimpleQueue[None] = queue.SimpleQueue()  # calls to fire even at MAX_IN_FLIGHT

    def fire_into(what: str) -> None:
        mark = len(fired)
        for _ in range(INTO_EACH):
            owed.put(None)
        _until(lambda: len(fired) >= mark + INTO_EACH, f"{INTO_EACH} calls fired into {what}")

    def restart(loop: asyncio.AbstractEventLoop, stopped: asyncio.Event) -> None:
        nonlocal new
        try:
            _until(lambda: _in_flight(address) > 0, "a call in flight")  # calls in flight first (one held)
            assert old.process is not None
            old.process.send_signal(signal.SIGTERM)
            _until(lambda: _draining(address), "draining")
            fire_into("the drain")  # refused: admission closes with the health
            hold.touch()  # the held call finishes; the drain ends and the event loop starves
            _until(Path(f"{starve}.held").exists, "starving")
            fire_into("the starved loop")  # accepted by grpc core, never handed to a handler
            starve.touch()  # the server stops: those calls are cancelled
            status.append(old.process.wait(60))
        finally:
            loop.call_soon_threadsafe(stopped.set)  # the race is over: the old server has exited
        new = _server(port, tmp_path / f"new-{trial}.log")

    async def load() -> list[GenerationResult | str]:
        stopped = asyncio.Event()
        in_flight = 0

        async def one(i: int, name: str = "call") -> GenerationResult | str:
            nonlocal in_flight
            request = build_request("hi", request_id=f"{name}-{trial}-{i}")
            in_flight += 1
            try:
                return await generate(channel, request, timeout_s=60, retry_unavailable=True)
            except grpc.aio.AioRpcError as exc:
                return f"{exc.code().name}: {exc.details()}"
            finally:
                in_flight -= 1

        async with open_channel(address) as channel:
            thread = threading.Thread(target=restart, args=(asyncio.get_running_loop(), stopped))
            thread.start()
            calls = [asyncio.ensure_future(one(0, "held"))]  # the drain waits for it until the test lets it go
            while not stopped.is_set() and len(calls) < MAX_CALLS:
                if in_flight < MAX_IN_FLIGHT or not owed.empty():
                    calls.append(asyncio.ensure_future(one(len(calls))))
                    fired.append(1)
                    with contextlib.suppress(queue.Empty):
                        owed.get_nowait()
                await asyncio.sleep(FIRE_EVERY_S)
            outcomes = list(await asyncio.gather(*calls))
            await asyncio.to_thread(thread.join, 60)
        return outcomes

    try:
        outcomes = asyncio.run(load())
    finally:
        hold.touch()
        starve.touch()
        for process in (old, new):
            if process is not None:
                process.stop()
    return outcomes, status[0] if status else None


@pytest.mark.timeout(240)
def test_calls_fired_into_a_stopping_server_are_retried_not_failed(tmp_path: Path) -> None:
    outcomes, status = _restart_under_load(tmp_path, 0)
    assert status == 0
    failed = [o for o in outcomes if isinstance(o, str)]
    assert not failed, (len(failed), len(outcomes), failed[:3])
    assert all(o.token_ids == [1] for o in outcomes if not isinstance(o, str))
    retried = Counter(code for o in outcomes if not isinstance(o, str) for code in o.retried_codes)
    print(f"retried: {dict(retried)} of {len(outcomes)} calls")
    # The race was exercised: some calls were cancelled by the stopping server (and then succeeded).
    assert retried["CANCELLED"] > 0, retried
    assert retried["UNAVAILABLE"] > 0, retried  # and some were refused while it drained
