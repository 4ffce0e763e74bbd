"""Drain on SIGTERM in the colocated and E+PD layouts (E/P/D: the rolling upgrade in
test_versions.py): requests in flight when the signal arrives finish with every token, new ones
are refused as "draining" (UNAVAILABLE), and the process exits 0 within its grace period. For E+PD
the PD service is drained under a router of its own over the session stack's encoders, which get
every embedding lease back.

The streams in flight at the signal are held before their decode (tests/support/gated.py) until
the test has seen the drain under way, so they are in flight then on any host, however fast.

The router's half of the stop race (the client's: tests/rpc/test_stop_race.py): a prefill restarted
on its port under load; what its draining server refused and what its stopping server cancelled
(grpc core's bare CANCELLED) the router waits out, so a client that never retries sees no failure.
The prefill's event loop is blocked between its drain and its server's stop until the router's
calls sent meanwhile have been forwarded to it (tests/support/gated.py), so the cancelling happens
on every restart, not only when a loaded host makes it."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import pytest

from libs.client.generate import GenerationResult, build_request, generate, open_channel
from libs.contract.epd.v1 import (
    chat_pb2,
    generate_pb2,
    generate_pb2_grpc,
    generation_pb2,
    prefill_decode_pb2,
    prefill_decode_pb2_grpc,
    sampling_pb2,
)
from libs.launch.process import ServiceProcess, free_port
from libs.launch.stack import Stack
from tests.support.golden import request_for
from tests.support.interposer import Interposer
from tests.support.stacks import MIXES, run_requests, wait_for, wait_pools_empty

TOKENS = 32  # past prefill's token: each stream decodes, once its gate opens
GRACE = ["--grace-s", "120"]
HELD = "drain-"  # the streams' request ids: held before their decode until the gate exists


def _long(name: str, request_id: str) -> generate_pb2.GenerateRequest:
    return request_for(MIXES[name], max_tokens=TOKENS, request_id=request_id)


def _gated(module: str, gate: Path) -> tuple[str, list[str]]:
    """`module` run with its `HELD` streams waiting for `gate` (tests/support/gated.py)."""
    return "tests.support.gated", ["--streams", HELD, str(gate), module]


async def _drained(
    address: str, process: ServiceProcess, names: list[str], gate: Path, refused: Callable[[], Awaitable[list[str]]]
) -> tuple[list[GenerationResult], list[str]]:
    """Stream one request per mix name (each held before its decode); once each has its first token,
    SIGTERM `process`; once `refused()` has seen a new request refused (the drain is under way),
    open `gate`. The finished streams, and what `refused()` saw."""
    async with open_channel(address) as channel:
        started = [asyncio.Event() for _ in names]

        async def one(i: int, name: str) -> GenerationResult:
            result = GenerationResult(request_id=f"{HELD}{i}")
            async for response in generate_pb2_grpc.GenerateServiceStub(channel).Generate(
                _long(name, result.request_id), timeout=300
            ):
                result.token_ids.extend(response.chunk.token_ids)
                if result.token_ids:
                    started[i].set()  # prefill's token (its text may be empty yet): now held at the gate
                if response.chunk.finish_reason:
                    result.finish_reason = generation_pb2.FinishReason.Name(response.chunk.finish_reason)
            return result

        streams = [asyncio.ensure_future(one(i, name)) for i, name in enumerate(names)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
        assert process.process is not None
        process.process.send_signal(signal.SIGTERM)
        probes = await asyncio.wait_for(refused(), 120)
        assert not [s for s in streams if s.done()]  # held: in flight while the drain refuses new work
        gate.touch()
        return list(await asyncio.gather(*streams)), probes


async def _probe_until_refused(address: str, send: Callable[[grpc.aio.Channel, str], Awaitable[None]]) -> list[str]:
    """One-token requests (`send(channel, request_id)`) until one is refused: the status of each
    ("OK" for those that got in before the signal took effect). Bounded by the caller."""
    probes: list[str] = []
    async with open_channel(address) as channel:
        while True:
            try:
                await send(channel, f"probe-{len(probes)}")
                probes.append("OK")
            except grpc.aio.AioRpcError as exc:
                probes.append(f"{exc.code().name}: {exc.details()}")
                return probes
            await asyncio.sleep(0.01)


async def _generate_one_token(channel: grpc.aio.Channel, request_id: str) -> None:
    one_token = sampling_pb2.SamplingParams(max_tokens=1)
    request = build_request("hi", sampling=one_token, request_id=request_id)
    async for _ in generate_pb2_grpc.GenerateServiceStub(channel).Generate(request, timeout=30):
        pass


async def _prefill_decode_one_token(channel: grpc.aio.Channel, request_id: str) -> None:
    request = prefill_decode_pb2.PrefillDecodeRequest(request_id=request_id)
    request.messages.add(role=chat_pb2.CHAT_ROLE_USER).parts.add(text="hi")
    request.sampling.max_tokens = 1
    async for _ in prefill_decode_pb2_grpc.PrefillDecodeServiceStub(channel).PrefillDecode(request, timeout=30):
        pass


def _check_finished(results: list[GenerationResult]) -> None:
    for result in results:
        assert (len(result.token_ids), result.finish_reason) == (TOKENS, "FINISH_REASON_LENGTH"), result.request_id


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_colocated_drains_in_flight_requests_and_refuses_new_ones(model_path: Path, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    module, gated = _gated("services.colocated", gate)
    service = ServiceProcess(
        "colocated", module, [*gated, "--model", str(model_path), *GRACE], log_path=tmp_path / "colocated.log"
    )
    service.start()
    try:
        service.wait_ready(120)
        names = ["image", "audio", "text"]
        probe = partial(_probe_until_refused, service.address, _generate_one_token)
        results, probes = asyncio.run(_drained(service.address, service, names, gate, probe))
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
    gate = tmp_path / "gate"
    module, gated = _gated("services.pd", gate)
    pd = ServiceProcess(
        "pd", module, [*gated, "--model", str(model_path), "--pool-mib", "64", *GRACE], log_path=tmp_path / "pd.log"
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
        names = ["two_images", "audio_image", "video"]
        probe = partial(_probe_until_refused, pd.address, _prefill_decode_one_token)  # at the PD itself
        results, probes = asyncio.run(_drained(router.address, pd, names, gate, probe))
        assert pd.process is not None
        assert pd.process.wait(120) == 0
    finally:
        if router is not None:
            assert router.stop() == 0
        pd.stop()
    _check_finished(results)
    *admitted, refused = probes
    assert set(admitted) <= {"OK"} and refused.startswith("UNAVAILABLE: ") and "draining" in refused, probes
    wait_pools_empty(stack)  # the drained PD read (and acked) every embedding it was sent


FIRE_EVERY_S = 0.01  # open loop while the prefill drains
MAX_CALLS = 60  # within the replacement prefill's admission (16 running + 64 waiting)
INTO_STOP = 8  # calls sent once the prefill's drain is over, before its server stops


def _first_token_only(request_id: str) -> generate_pb2.GenerateRequest:
    return request_for(MIXES["text"], max_tokens=1, request_id=request_id)  # prefill's token: no decode


async def _prefill_restarted_under_load(
    address: str, prefill: ServiceProcess, gate: Path, interposer: Interposer, forwarded: list[str]
) -> tuple[list[Any], set[str], int | None]:
    """Fire one-token requests at the router while `prefill` is stopped (SIGTERM: drain, then its
    server stops) and started again on its port; every outcome (a result, or the client's error),
    the requests sent into the stop, and the old process's exit status. The client never retries.

    Once the drain is over the prefill's event loop is blocked at `gate` (tests/support/gated.py):
    the `INTO_STOP` requests sent then are forwarded by the interposer (`forwarded`: request ids its
    hook saw) to a server that accepts their calls and cannot handle them; once all were, `gate`
    opens and the server stops, cancelling them (grpc core's bare CANCELLED)."""
    async with open_channel(address) as channel:

        async def one(i: int) -> GenerationResult | str:
            try:
                return await generate(channel, _first_token_only(f"restart-{i}"), timeout_s=240)
            except grpc.aio.AioRpcError as exc:
                return f"{exc.code().name}: {exc.details()}"

        calls = []
        for _ in range(20):  # calls in flight first
            calls.append(asyncio.ensure_future(one(len(calls))))
            await asyncio.sleep(FIRE_EVERY_S)
        stopping = asyncio.ensure_future(asyncio.to_thread(prefill.stop, 180))
        held = Path(f"{gate}.held")  # the drain is over: the loop blocks at the gate
        while not held.exists() and len(calls) < MAX_CALLS - INTO_STOP:
            calls.append(asyncio.ensure_future(one(len(calls))))
            await asyncio.sleep(FIRE_EVERY_S)
        await asyncio.to_thread(wait_for, held.exists, 120, "the prefill's drain to end")
        into_stop = {f"restart-{i}" for i in range(len(calls), len(calls) + INTO_STOP)}
        calls += [asyncio.ensure_future(one(len(calls) + i)) for i in range(INTO_STOP)]
        sent_on = lambda: into_stop <= set(forwarded[:])  # noqa: E731
        await asyncio.to_thread(wait_for, sent_on, 120, "the calls into the stop forwarded to the prefill")
        interposer.run(asyncio.sleep(0))  # its loop has sent them on
        gate.touch()
        status = await stopping
        prefill.start()  # the same arguments, the same port
        await asyncio.to_thread(prefill.wait_ready, 240)
        return list(await asyncio.gather(*calls)), into_stop, status


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
    gate = tmp_path / "gate"
    prefill = ServiceProcess(
        "prefill",
        "tests.support.gated",
        ["--stop", str(gate), "services.prefill", "--model", str(model_path), "--pool-mib", "64", "--port", str(port)],
        log_path=tmp_path / "prefill.log",
    )
    prefill.start()
    interposer = Interposer(f"127.0.0.1:{port}")
    forwarded: list[str] = []  # request ids of the router's Prefill calls, as the interposer forwards them

    async def record(request: Any) -> None:
        forwarded.append(request.request_id)

    interposer.hooks["Prefill"] = record
    router = None
    status: int | None = None
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
        outcomes, into_stop, status = asyncio.run(
            _prefill_restarted_under_load(router.address, prefill, gate, interposer, forwarded)
        )
        failed = [o for o in outcomes if isinstance(o, str)]
        assert not failed, (len(failed), len(outcomes), failed[:3])
        assert all(o.token_ids == want.token_ids for o in outcomes)
        with interposer.changed:
            seen = {rid: list(o) for rid, o in interposer.outcomes.items() if rid.startswith("restart-")}
        seen.pop("restart-baseline")
        assert len(seen) == len(outcomes)
        cancelled = {rid: o for rid, o in seen.items() if "CANCELLED" in o}
    finally:
        if router is not None:
            assert router.stop() == 0
        interposer.stop()
        final = prefill.stop()
    assert status == 0 and final == 0, (status, final, prefill.log_tail())
    # The race was exercised: prefill's stopping server cancelled calls of the router's (a bare
    # CANCELLED), those sent into its stop among them, and the router sent each of those requests
    # again until the replacement served it.
    assert set(cancelled) & into_stop, (cancelled, {rid: seen[rid] for rid in into_stop})
    assert all(o[-1] == "OK" for o in cancelled.values()), cancelled
    print(f"cancelled by the stopping prefill, then served: {len(cancelled)} requests ({len(into_stop)} sent into it)")
    wait_pools_empty(stack)
