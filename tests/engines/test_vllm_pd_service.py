"""A PD service on vLLM on its own (text requests need no encoder): its Prometheus metrics, the
priority order inside vLLM's scheduler, drain on SIGTERM.

The service runs one sequence at a time (`--max-batch 1`, vLLM's max_num_seqs) and admits more
(`--max-running`): the rest wait inside vLLM, where only vLLM's scheduler orders them. The drain
test runs last: it stops the service."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

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
from tests.support.vllm_stack import (
    TokenStream,
    probe_until_refused,
    sample_values,
    scrape,
    stage_kinds,
    stats,
    until_draining,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ADMITTED = 6  # the filler and the requests queued behind it, all inside vLLM
# Sent together behind the filler: distinct priorities, so the order is vLLM's by priority alone
# (the filler, at most ~4000 tokens, can end within a second on a fast host: no time to queue them
# one at a time).
ARRIVALS = [("low-1", -10), ("low-2", -20), ("high", 50), ("default", 0)]
# Each request of the drain test: the two waiting behind the running one outlast the probes that
# follow the signal even on a fast host (one run of 512 drained before the first probe).
DRAINED_TOKENS = 2000


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
    process = ServiceProcess("pd", "services.pd", args, log_path=tmp_path_factory.mktemp("vllm-pd") / "pd.log")
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

        async def until_waiting_in_vllm(n: int) -> None:
            for _ in range(3000):  # bounded: the gauge moves at every engine step (the filler's)
                if await asyncio.to_thread(pd.gauge, "vllm:num_requests_waiting") == n:
                    return
                await asyncio.sleep(0.01)
            raise AssertionError(f"never {n} requests waiting in vLLM")

        filler = TokenStream(stub.PrefillDecode(_request("filler", "Count forever.", 4000), timeout=240))
        filling = asyncio.ensure_future(filler.run())
        await asyncio.wait_for(filler.first.wait(), 120)  # it holds vLLM's only running slot
        order: list[str] = []

        async def queued(name: str, priority: int) -> None:
            stream = TokenStream(stub.PrefillDecode(_request(name, "Say something.", 4, priority), timeout=240))
            running = asyncio.ensure_future(stream.run())
            await stream.first.wait()
            order.append(name)  # its first token: vLLM scheduled it
            await running

        waiting = []
        try:
            waiting = [asyncio.ensure_future(queued(name, priority)) for name, priority in ARRIVALS]
            await until_waiting_in_vllm(len(ARRIVALS))
            assert order == []  # all four wait inside vLLM (admission let them in)
            filler.call.cancel()  # vLLM's one slot frees, and cycles through its waiting requests
            await asyncio.wait_for(asyncio.gather(*waiting), 120)
            return order
        finally:
            filler.call.cancel()
            for task in (filling, *waiting):
                task.cancel()
            await asyncio.gather(filling, *waiting, return_exceptions=True)


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


async def _drained(pd: PdService, texts: list[str]) -> tuple[list[int], list[str], list[list[int]]]:
    async with open_channel(pd.address) as channel:
        stub = prefill_decode_pb2_grpc.PrefillDecodeServiceStub(channel)
        streams: list[TokenStream] = []
        done: list[asyncio.Future[list[int]]] = []
        for i, text in enumerate(texts):  # one at a time, each admitted before the next is sent
            streams.append(TokenStream(stub.PrefillDecode(_request(f"drain-{i}", text, DRAINED_TOKENS), timeout=600)))
            done.append(asyncio.ensure_future(streams[-1].run()))
            seen: list[int] = []
            for _ in range(1000):  # bounded
                seen.append((await stats(pd.address)).requests_in_flight)
                if seen[-1] == i + 1:
                    break
                await asyncio.sleep(0.01)
            else:
                ended = [repr(d.exception() or d.result()) for d in done if d.done()]
                raise AssertionError(
                    f"request {i} not admitted beside the others: in flight {sorted(set(seen))}; {ended}"
                )
        # One runs (whichever vLLM took first), the others wait inside vLLM (one slot).
        firsts = [asyncio.ensure_future(s.first.wait()) for s in streams]
        await asyncio.wait(firsts, timeout=120, return_when=asyncio.FIRST_COMPLETED)
        for first in firsts:
            first.cancel()
        assert pd.process.process is not None
        pd.process.process.terminate()  # SIGTERM
        at_signal = [len(s.tokens) for s in streams]
        await until_draining(pd.address)
        probes = await probe_until_refused(lambda: _generate(pd.address, _request("probe", "Hi.", 1)))
        return at_signal, probes, list(await asyncio.gather(*done))


@pytest.mark.timeout(1200)
def test_drain_finishes_running_and_waiting_requests_and_refuses_new_ones(pd: PdService) -> None:
    texts = ["Tell a story.", "Name some colours.", "Describe the sea."]
    undisturbed = [asyncio.run(_generate(pd.address, _request("undisturbed", t, DRAINED_TOKENS))) for t in texts]
    at_signal, probes, finished = asyncio.run(_drained(pd, texts))
    assert all(n < DRAINED_TOKENS for n in at_signal), at_signal  # in flight (running or waiting) at the signal
    assert finished == undisturbed  # every token
    *before, refused = probes
    assert set(before) <= {"OK"} and refused.startswith("UNAVAILABLE: ") and "draining" in refused, probes
    assert pd.process.process is not None and pd.process.process.wait(120) == 0, pd.process.log_tail()
