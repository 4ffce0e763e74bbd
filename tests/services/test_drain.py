"""Drain on SIGTERM in the colocated and E+PD layouts (E/P/D: the rolling upgrade in
test_versions.py): requests in flight when the signal arrives finish with every token, new ones
are refused as "draining" (UNAVAILABLE), and the process exits 0 within its grace period. For E+PD
the PD service is drained under a router of its own over the session stack's encoders, which get
every embedding lease back.

The router's half of the stop race (the client's: tests/rpc/test_stop_race.py): a prefill restarted
on its port under load; what its draining server refused and what its stopping server cancelled
(grpc core's bare CANCELLED) the router waits out, so a client that never retries sees no failure.
The prefill's event loop is starved for a moment before its server stops (tests/support/starved_stop.py),
so the cancelling happens on every restart, not only when a loaded host makes it."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from libs.client.generate import GenerationResult, build_request, generate, open_channel
from libs.contract.epd.v1 import generate_pb2, generate_pb2_grpc, sampling_pb2
from libs.launch.process import ServiceProcess, free_port
from libs.launch.stack import Stack
from tests.support.golden import request_for
from tests.support.interposer import Interposer
from tests.support.stacks import MIXES, run_requests, wait_pools_empty

TOKENS = 256  # in flight for a good while after the signal, done well within the grace period
GRACE = ["--grace-s", "120"]


def _long(name: str, request_id: str) -> generate_pb2.GenerateRequest:
    return request_for(MIXES[name], max_tokens=TOKENS, request_id=request_id)


async def _drained(
    address: str, process: ServiceProcess, names: list[str], probe: bool
) -> tuple[list[GenerationResult], list[str]]:
    """Stream one request per mix name; once each has its first token, SIGTERM `process`; with
    `probe`, send one-token requests until one is refused. The finished streams, and the status
    of each probe ("OK" for those that got in before the signal took effect)."""
    async with open_channel(address) as channel:
        started = [asyncio.Event() for _ in names]

        async def one(i: int, name: str) -> GenerationResult:
            return await generate(channel, _long(name, f"drain-{i}"), timeout_s=300, on_text=lambda _: started[i].set())

        streams = [asyncio.ensure_future(one(i, name)) for i, name in enumerate(names)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
        assert process.process is not None
        process.process.send_signal(signal.SIGTERM)
        probes: list[str] = []
        if probe:
            stub = generate_pb2_grpc.GenerateServiceStub(channel)
            one_token = sampling_pb2.SamplingParams(max_tokens=1)
            for n in range(200):  # bounded: the signal is handled within moments
                try:
                    async for _ in stub.Generate(
                        build_request("hi", sampling=one_token, request_id=f"probe-{n}"), timeout=30
                    ):
                        pass
                    probes.append("OK")
                except grpc.aio.AioRpcError as exc:
                    probes.append(f"{exc.code().name}: {exc.details()}")
                    break
                await asyncio.sleep(0.01)
        return list(await asyncio.gather(*streams)), probes


def _check_finished(results: list[GenerationResult]) -> None:
    for result in results:
        assert (len(result.token_ids), result.finish_reason) == (TOKENS, "FINISH_REASON_LENGTH"), result.request_id


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_colocated_drains_in_flight_requests_and_refuses_new_ones(model_path: Path, tmp_path: Path) -> None:
    service = ServiceProcess(
        "colocated", "services.colocated", ["--model", str(model_path), *GRACE], log_path=tmp_path / "colocated.log"
    )
    service.start()
    try:
        service.wait_ready(120)
        results, probes = asyncio.run(_drained(service.address, service, ["image", "audio", "text"], probe=True))
        assert service.process is not None
        assert service.process.wait(120) == 0  # exits by itself once drained, cleanly
    finally:
        service.stop()
    _check_finished(results)
    *admitted, refused = probes
    assert set(admitted) <= {"OK"} and refused.startswith("UNAVAILABLE: ") and "draining" in refused, probes


@pytest.mark.stack
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pd_drains_in_flight_requests(stacks: Callable[[str], Stack], model_path: Path, tmp_path: Path) -> None:
    stack = stacks("e+pd")
    pd = ServiceProcess(
        "pd", "services.pd", ["--model", str(model_path), "--pool-mib", "64", *GRACE], log_path=tmp_path / "pd.log"
    )
    pd.start()
    router = None
    try:
        pd.wait_ready(120)
        encoders = ",".join(p.address for n, p in stack.processes.items() if n.startswith("encoder-"))
        router = ServiceProcess(
            "router",
            "services.router",
            ["--layout", "e+pd", "--encoders", encoders, "--pd", pd.address],
            log_path=tmp_path / "router.log",
        )
        router.start()
        router.wait_ready(60)
        results, _ = asyncio.run(_drained(router.address, pd, ["two_images", "audio_image", "video"], probe=False))
        assert pd.process is not None
        assert pd.process.wait(120) == 0
    finally:
        if router is not None:
            assert router.stop() == 0
        pd.stop()
    _check_finished(results)
    wait_pools_empty(stack)  # the drained PD read (and acked) every embedding it was sent


FIRE_EVERY_S = 0.01  # open loop while the prefill drains and stops
MAX_CALLS = 60  # within the replacement prefill's admission (16 running + 64 waiting)
STARVED_S = 0.3  # prefill's event loop, blocked between its drain and its server's stop


def _first_token_only(request_id: str) -> generate_pb2.GenerateRequest:
    return request_for(MIXES["text"], max_tokens=1, request_id=request_id)  # prefill's token: no decode


async def _prefill_restarted_under_load(
    address: str, prefill: ServiceProcess, trial: int
) -> tuple[list[Any], int | None]:
    """Fire one-token requests at the router while `prefill` is stopped (SIGTERM: drain, then its
    server stops) and started again on its port; every outcome (a result, or the client's error),
    and the old process's exit status. The client never retries."""
    async with open_channel(address) as channel:

        async def one(i: int) -> GenerationResult | str:
            try:
                return await generate(channel, _first_token_only(f"restart-{trial}-{i}"), timeout_s=240)
            except grpc.aio.AioRpcError as exc:
                return f"{exc.code().name}: {exc.details()}"

        calls = []
        for _ in range(20):  # calls in flight first
            calls.append(asyncio.ensure_future(one(len(calls))))
            await asyncio.sleep(FIRE_EVERY_S)
        stopping = asyncio.ensure_future(asyncio.to_thread(prefill.stop, 60))
        while not stopping.done() and len(calls) < MAX_CALLS:
            calls.append(asyncio.ensure_future(one(len(calls))))
            await asyncio.sleep(FIRE_EVERY_S)
        status = await stopping
        prefill.start()  # the same arguments, the same port
        await asyncio.to_thread(prefill.wait_ready, 240)
        return list(await asyncio.gather(*calls)), status


@pytest.mark.stack
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_router_waits_out_a_prefill_restart_under_load(
    stacks: Callable[[str], Stack], model_path: Path, tmp_path: Path
) -> None:
    """A router of our own over the session stack's encoders and decode and a prefill of our own,
    reached through an interposer that records what prefill answered each of the router's calls."""
    stack = stacks("e/p/d")
    port = free_port()
    prefill = ServiceProcess(
        "prefill",
        "tests.support.starved_stop",
        [str(STARVED_S), "services.prefill", "--model", str(model_path), "--pool-mib", "64", "--port", str(port)],
        log_path=tmp_path / "prefill.log",
    )
    prefill.start()
    interposer = Interposer(f"127.0.0.1:{port}")
    router = None
    statuses: list[int | None] = []
    cancelled: dict[str, list[str]] = {}
    try:
        prefill.wait_ready(240)
        interposer.start()
        encoders = ",".join(p.address for n, p in stack.processes.items() if n.startswith("encoder-"))
        router = ServiceProcess(
            "router",
            "services.router",
            [
                "--encoders", encoders,
                "--prefill", interposer.address,
                "--decode", stack.processes["decode"].address,
            ],
            log_path=tmp_path / "router.log",
        )  # fmt: skip
        router.start()
        router.wait_ready(60)
        (want,) = run_requests(router.address, [_first_token_only("restart-baseline")])
        for trial in range(3):  # until the stopping server cancelled a call (the first trial), bounded
            outcomes, status = asyncio.run(_prefill_restarted_under_load(router.address, prefill, trial))
            statuses.append(status)
            failed = [o for o in outcomes if isinstance(o, str)]
            assert not failed, (len(failed), len(outcomes), failed[:3])
            assert all(o.token_ids == want.token_ids for o in outcomes)
            with interposer.changed:
                seen = {rid: list(o) for rid, o in interposer.outcomes.items() if rid.startswith(f"restart-{trial}-")}
            assert len(seen) == len(outcomes)
            cancelled = {rid: o for rid, o in seen.items() if "CANCELLED" in o}
            if cancelled:
                break
    finally:
        if router is not None:
            assert router.stop() == 0
        interposer.stop()
        final = prefill.stop()
    assert statuses == [0] * len(statuses) and final == 0, (statuses, final, prefill.log_tail())
    # The race was exercised: prefill's stopping server cancelled calls of the router's (a bare
    # CANCELLED), and the router sent each of those requests again until the replacement served it.
    assert cancelled, f"no call was cancelled by the stopping prefill in {len(statuses)} restarts"
    assert all(o[-1] == "OK" for o in cancelled.values()), cancelled
    print(f"cancelled by the stopping prefill, then served: {len(cancelled)} requests in {len(statuses)} restart(s)")
    wait_pools_empty(stack)
