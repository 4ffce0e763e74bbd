"""A PD service on vLLM on its own (text requests need no encoder): its Prometheus metrics, the
priority order inside vLLM's scheduler, drain on SIGTERM.

The service runs one sequence at a time (`--max-batch 1`, vLLM's max_num_seqs) and admits more
(`--max-running`): the rest wait inside vLLM, where only vLLM's scheduler orders them. The drain
test runs last: it stops the service."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from libs.contract.epd.v1 import (
    chat_pb2,
    prefill_decode_pb2,
    prefill_decode_pb2_grpc,
    sampling_pb2,
    service_info_pb2,
    service_info_pb2_grpc,
)
from libs.launch.k8s import LANE_LABEL, OCCUPANCY_METRIC
from libs.launch.process import ServiceProcess, free_port
from libs.rpc.admission import CAPABILITY as ADMISSION_PRIORITY
from libs.rpc.server import open_channel
from tests.support.metrics import sample_values, scrape
from tests.support.vllm_stack import (
    TokenStream,
    frozen_engine,
    probe_until_refused,
    stage_kinds,
    stats,
    until_draining,
    until_in_flight,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ADMITTED = 6  # the filler and the requests queued behind it, all inside vLLM
# Sent together behind the filler: distinct priorities, so the order is vLLM's by priority alone.
ARRIVALS = [("low-1", -10), ("low-2", -20), ("high", 50), ("default", 0)]
# The filler holds vLLM's one running slot while the four queue behind it. It and then they reach
# vLLM while its engine is stopped (frozen_engine): the filler first, at the highest priority, so it
# takes the slot once the engine runs, and it cannot end before they are queued, however fast the
# engine (the longest request there is, the contract's max_tokens).
FILLER = ("filler", "Count forever.")
FILLER_TOKENS, FILLER_PRIORITY = 4096, 100
DRAINED_TOKENS = 64  # each request of the drain test, compared with its undisturbed run
# Placed as the launcher places a small host (libs/launch/placement.py): vLLM's engine alone on the
# last CPU, the service on the others (on one CPU, both there).
ENGINE_CPU = max(os.sched_getaffinity(0))
SERVICE_CPUS = frozenset(os.sched_getaffinity(0) - {ENGINE_CPU}) or frozenset({ENGINE_CPU})


class PdService:
    def __init__(self, process: ServiceProcess, metrics_port: int) -> None:
        self.process = process
        self.address = process.address
        self.metrics_port = metrics_port

    def metrics(self) -> str:
        return scrape(self.metrics_port)

    def gauge(self, name: str) -> float:
        """vLLM's gauge `name` (one engine, so one sample)."""
        (value,) = sample_values(self.metrics(), name)
        return value


@pytest.fixture(scope="module")
def pd(omni_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdService]:
    port = free_port()
    args = ["--engine", "vllm", "--model", str(omni_tiny), "--max-batch", "1", "--max-running", str(ADMITTED)]
    args += ["--metrics-port", str(port), "--grace-s", "240"]
    args += ["--engine-hang-timeout-s", "600"]  # frozen_engine stops it on purpose: not a hang
    args += ["--max-model-len", "8192"]  # the filler's prompt and the longest max_tokens (4096)
    args += ["--engine-cpus", str(ENGINE_CPU)]
    log = tmp_path_factory.mktemp("vllm-pd") / "pd.log"
    process = ServiceProcess("pd", "services.pd", args, log_path=log, cpus=SERVICE_CPUS)
    process.start()
    try:
        process.wait_ready(420)
        yield PdService(process, port)
    finally:
        process.stop(60)


def _request(name: str, text: str, max_tokens: int, priority: int = 0) -> prefill_decode_pb2.PrefillDecodeRequest:
    return prefill_decode_pb2.PrefillDecodeRequest(
        request_id=f"{name}-{time.monotonic_ns()}",
        messages=[chat_pb2.ChatMessage(role=chat_pb2.CHAT_ROLE_USER, parts=[chat_pb2.ContentPart(text=text)])],
        sampling=sampling_pb2.SamplingParams(max_tokens=max_tokens),
        priority=priority,
    )


async def _generate(address: str, req: prefill_decode_pb2.PrefillDecodeRequest) -> list[int]:
    async with open_channel(address) as channel:
        stub = prefill_decode_pb2_grpc.PrefillDecodeServiceStub(channel)
        return await TokenStream(stub.PrefillDecode(req, timeout=600)).run()


def test_the_engine_runs_on_its_cpus_and_the_service_keeps_its_own(pd: PdService) -> None:
    service = psutil.Process(pd.process.pid)
    engines = [p for p in service.children(recursive=True) if "EngineCore" in p.name()]
    assert engines, [p.name() for p in service.children(recursive=True)]
    for engine in engines:
        assert {frozenset(os.sched_getaffinity(t.id)) for t in engine.threads()} == {frozenset({ENGINE_CPU})}
    assert {frozenset(os.sched_getaffinity(t.id)) for t in service.threads()} == {SERVICE_CPUS}


def test_metrics_are_the_reference_services_and_vllms_own(pd: PdService) -> None:
    tokens = asyncio.run(_generate(pd.address, _request("metrics", "Say something.", 4)))
    assert len(tokens) == 4
    text = pd.metrics()
    assert {"queue", "prefill", "decode"} <= stage_kinds(text), stage_kinds(text)
    assert "epd_stage_duration_seconds_bucket" in text
    # The load gauge the autoscaler reads, for this service's lane: idle now.
    occupancy = [line for line in text.splitlines() if line.startswith(OCCUPANCY_METRIC + "{")]
    assert any(f'{LANE_LABEL}="pd"' in line and line.endswith(" 0.0") for line in occupancy), occupancy
    # vLLM's scheduler gauges and counters, from the engine itself.
    assert pd.gauge("vllm:num_requests_running") == 0 and pd.gauge("vllm:num_requests_waiting") == 0
    assert 0 <= pd.gauge("vllm:kv_cache_usage_perc") < 1
    assert pd.gauge("vllm:generation_tokens_total") >= 4


async def _served_order(pd: PdService) -> list[str]:
    async with open_channel(pd.address) as channel:
        stub = prefill_decode_pb2_grpc.PrefillDecodeServiceStub(channel)
        order: list[str] = []
        tasks: list[asyncio.Future[Any]] = []
        calls: list[Any] = []

        def stream(name: str, text: str, max_tokens: int, priority: int) -> TokenStream:
            call = stub.PrefillDecode(_request(name, text, max_tokens, priority), timeout=240)
            calls.append(call)
            return TokenStream(call)

        async def queued(name: str, priority: int) -> None:
            tokens = stream(name, "Say something.", 4, priority)
            running = asyncio.ensure_future(tokens.run())
            await tokens.first.wait()
            order.append(name)  # its first token: vLLM scheduled it
            await running

        async def until_waiting_in_vllm(n: int, filling: asyncio.Future[Any]) -> None:
            """Until `n` wait in vLLM (the gauge moves at every engine step, the filler's), or the
            filler ended by itself: they were all queued behind it by then (bounded)."""
            for _ in range(3000):
                if filling.done() or await asyncio.to_thread(pd.gauge, "vllm:num_requests_waiting") == n:
                    return
                await asyncio.sleep(0.01)
            raise AssertionError(f"never {n} requests waiting in vLLM")

        try:
            with frozen_engine(pd.process):
                filler = stream(*FILLER, FILLER_TOKENS, FILLER_PRIORITY)
                filling = asyncio.ensure_future(filler.run())
                tasks.append(filling)
                await until_active(pd.address, 1)  # handed to vLLM's client (sent on before the rest)
                tasks += [asyncio.ensure_future(queued(name, priority)) for name, priority in ARRIVALS]
                await until_in_flight(pd.address, 1 + len(ARRIVALS))  # admitted by the service
                await until_active(pd.address, 1 + len(ARRIVALS))  # and handed to vLLM's client
            await asyncio.wait_for(filler.first.wait(), 120)  # it holds vLLM's only running slot
            await until_waiting_in_vllm(len(ARRIVALS), filling)
            assert filling.done() or order == []  # all four wait inside vLLM (admission let them in)
            filler.call.cancel()  # vLLM's one slot frees, and cycles through its waiting requests
            await asyncio.wait_for(asyncio.gather(*tasks[1:]), 120)
            return order
        finally:
            for call in calls:
                call.cancel()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def until_active(address: str, count: int, timeout_s: float = 120.0) -> None:
    """Until the service's engine has `count` requests (GetStats active_sequences), bounded."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (await stats(address)).active_sequences < count:
        assert asyncio.get_running_loop().time() < deadline, f"never {count} requests in the engine"
        await asyncio.sleep(0.01)


async def _capabilities(address: str) -> list[str]:
    async with open_channel(address) as channel:
        reply = await service_info_pb2_grpc.ServiceInfoServiceStub(channel).GetServiceInfo(
            service_info_pb2.GetServiceInfoRequest(), timeout=10
        )
        return list(reply.info.capabilities)


@pytest.mark.timeout(300)
def test_requests_waiting_in_vllm_are_scheduled_by_priority(pd: PdService) -> None:
    # Advertised as the reference services do: the router forwards priorities only to such peers.
    assert {ADMISSION_PRIORITY, "engine.vllm"} <= set(asyncio.run(_capabilities(pd.address)))
    assert asyncio.run(_served_order(pd)) == ["high", "default", "low-1", "low-2"]
    deadline = time.monotonic() + 30
    while asyncio.run(stats(pd.address)).active_sequences:  # the cancelled filler aborted in vLLM
        assert time.monotonic() < deadline, "a sequence stayed in vLLM"
        time.sleep(0.1)


def _held_so_far(pd: PdService) -> float:
    """Requests the service held for a round so far (`pd.prefill_batch` spans' histogram count)."""
    return sum(sample_values(pd.metrics(), "epd_stage_duration_seconds_count", 'epd_span="pd.prefill_batch"'))


async def _until_gauge(pd: PdService, name: str, value: float, timeout_s: float = 120.0) -> None:
    """Until the service's gauge `name` reads `value`, bounded."""
    deadline = time.monotonic() + timeout_s
    while (got := await asyncio.to_thread(pd.gauge, name)) != value:
        assert time.monotonic() < deadline, f"{name} = {got}, never {value}"
        await asyncio.sleep(0.01)


@pytest.mark.timeout(300)
def test_a_request_arriving_mid_decode_waits_in_the_service_for_the_next_round(pd: PdService) -> None:
    """--prefill-batch-steps (16 by default): a request reaching the PD while another decodes is held
    by the service, not queued in vLLM, until the running one made 16 steps; then it goes into vLLM
    (here behind the running one: a batch of one) and is served as it would be alone."""
    alone = asyncio.run(_generate(pd.address, _request("alone", "Say hi.", 4)))
    held_before = _held_so_far(pd)

    async def scenario() -> tuple[float, list[int]]:
        async with open_channel(pd.address) as channel:
            stub = prefill_decode_pb2_grpc.PrefillDecodeServiceStub(channel)
            decoding_req = _request("decoding", "Count on.", FILLER_TOKENS)
            decoding_req.sampling.ignore_eos = True
            decoding = TokenStream(stub.PrefillDecode(decoding_req, timeout=240))
            running = asyncio.ensure_future(decoding.run())
            late: asyncio.Future[list[int]] | None = None
            try:
                # The engine stopped while both arrive: the decoding one is let into vLLM and can
                # make no step, so the arriving one finds it inside its window, however fast the
                # host or slow this client.
                with frozen_engine(pd.process) as thaw:
                    await _until_gauge(pd, "epd_prefill_batch_running", 1)
                    arriving = TokenStream(stub.PrefillDecode(_request("arriving", "Say hi.", 4), timeout=240))
                    late = asyncio.ensure_future(arriving.run())
                    await _until_gauge(pd, "epd_prefill_batch_held", 1)
                    thaw()
                # Let in after the decoding one's 16 steps: waiting in vLLM behind it, for as long
                # as that one decodes (its 4096 tokens); the time bound only stops a runaway.
                bound = time.monotonic() + 200
                while await asyncio.to_thread(pd.gauge, "vllm:num_requests_waiting") != 1:
                    if running.done() or time.monotonic() > bound:
                        raise AssertionError("the arriving request never reached vLLM while the other decoded")
                    await asyncio.sleep(0.01)
                held = await asyncio.to_thread(_held_so_far, pd) - held_before  # recorded as it went in
                decoding.call.cancel()  # vLLM's one slot frees
                return held, await asyncio.wait_for(late, 120)
            finally:
                decoding.call.cancel()
                await asyncio.gather(running, *([late] if late else []), return_exceptions=True)

    held, tokens = asyncio.run(scenario())
    assert held == 1
    assert tokens == alone


async def _drained(pd: PdService, texts: list[str]) -> tuple[int, list[str], list[list[int]]]:
    async with open_channel(pd.address) as channel:
        stub = prefill_decode_pb2_grpc.PrefillDecodeServiceStub(channel)
        # vLLM's engine is stopped while they arrive: the service admits all three and none can
        # advance until the test thaws it, after the signal and the probes, on a fast host as on a
        # slow one. Then one runs and the others wait inside vLLM (one slot), during the drain.
        with frozen_engine(pd.process) as thaw:
            streams = [
                TokenStream(stub.PrefillDecode(_request(f"drain-{i}", text, DRAINED_TOKENS), timeout=600))
                for i, text in enumerate(texts)
            ]
            done = [asyncio.ensure_future(s.run()) for s in streams]
            await until_in_flight(pd.address, len(texts))
            assert pd.process.process is not None
            pd.process.process.terminate()  # SIGTERM
            at_signal = (await stats(pd.address)).requests_in_flight
            await until_draining(pd.address)
            probes = await probe_until_refused(lambda: _generate(pd.address, _request("probe", "Hi.", 1)))
            thaw()
            return at_signal, probes, list(await asyncio.gather(*done))


@pytest.mark.timeout(1200)
def test_drain_finishes_running_and_waiting_requests_and_refuses_new_ones(pd: PdService) -> None:
    texts = ["Tell a story.", "Name some colours.", "Describe the sea."]
    undisturbed = [asyncio.run(_generate(pd.address, _request("undisturbed", t, DRAINED_TOKENS))) for t in texts]
    at_signal, probes, finished = asyncio.run(_drained(pd, texts))
    assert at_signal == len(texts)  # in flight at the signal (held by the stopped engine)
    assert finished == undisturbed  # every token
    *before, refused = probes
    assert set(before) <= {"OK"} and refused.startswith("UNAVAILABLE: ") and "draining" in refused, probes
    assert pd.process.process is not None and pd.process.process.wait(120) == 0, pd.process.log_tail()
