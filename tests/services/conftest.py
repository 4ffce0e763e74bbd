"""Service-level fixtures: real stacks (one process per service, loopback gRPC), started once per
test session per layout and stopped by PID at the end, and the colocated model's reference.

Every session stack exports its spans over OTLP/gRPC to one real receiver in this process
(`receiver`), so a test can check what the services did, not only what the client saw: send a call
with a trace id of its own (`traced()`) and read that trace's spans (`trace_spans()`)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from libs.client.generate import GenerationResult, generate, open_channel
from libs.contract.epd.v1 import generate_pb2
from libs.engine.checkpoints import ensure_checkpoint
from libs.engine.encoder_runner import EncoderRunner
from libs.engine.lm_runtime import LanguageModelRuntime
from libs.launch.stack import Stack, StackSpec
from libs.telemetry.spans import OtlpReceiver, SpanRecord
from tests.engine.mixes import mixes
from tests.engine.reference import load_reference
from tests.services.golden import ALL_MODALITIES, expected_tokens

MIXES = {mix.name: mix for mix in mixes(ALL_MODALITIES)}


@pytest.fixture(scope="session")
def model_path() -> Path:
    return ensure_checkpoint("qwen2_5_omni", "tiny")


@pytest.fixture(scope="session")
def expected(model_path: Path) -> dict[str, list[int]]:
    """Greedy tokens of the model's own generate() for every mix."""
    model = load_reference(str(model_path))
    runtime = LanguageModelRuntime(model_path)
    adapter = EncoderRunner(model_path).adapter
    return {name: expected_tokens(model, runtime, adapter, mix) for name, mix in MIXES.items()}


@pytest.fixture(scope="session")
def receiver() -> Iterator[OtlpReceiver]:
    """A real OTLP/gRPC trace receiver on loopback that the session stacks export to."""
    otlp = OtlpReceiver().start()
    yield otlp
    otlp.stop()


def tracing_env(otlp: OtlpReceiver) -> dict[str, str]:
    """Environment that makes a service export its spans to `otlp` (batches every 200 ms)."""
    return {"EPD_TRACE_EXPORTER": "otlp", "EPD_OTLP_ENDPOINT": otlp.address, "OTEL_BSP_SCHEDULE_DELAY": "200"}


def traced() -> tuple[str, tuple[tuple[str, str], ...]]:
    """A fresh trace id and the call metadata that makes the callee's spans join that trace."""
    trace_id = os.urandom(16).hex()
    return trace_id, (("traceparent", f"00-{trace_id}-{os.urandom(8).hex()}-01"),)


def trace_spans(
    otlp: OtlpReceiver, trace_id: str, until: Callable[[list[SpanRecord]], bool], timeout_s: float = 30.0
) -> list[SpanRecord]:
    """The spans of one trace received so far, once `until(spans)` holds (spans arrive in batches)."""
    deadline = time.monotonic() + timeout_s
    while True:
        spans = [s for s in otlp.snapshot() if s.trace_id == trace_id]
        if until(spans):
            return spans
        if time.monotonic() > deadline:
            raise AssertionError(f"trace {trace_id}: condition not met after {timeout_s} s; spans: {spans}")
        time.sleep(0.05)


def wait_for(condition: Callable[[], object], timeout_s: float, what: str, poll_s: float = 0.02) -> None:
    """Poll `condition` until it is truthy; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(poll_s)


@pytest.fixture(scope="session")
def stacks(
    model_path: Path, tmp_path_factory: pytest.TempPathFactory, receiver: OtlpReceiver
) -> Iterator[Callable[[str], Stack]]:
    """`stacks(layout)` starts that layout's stack on first use; all stop at session end."""
    started: dict[str, Stack] = {}

    def get(layout: str) -> Stack:
        if layout not in started:
            run_dir = tmp_path_factory.mktemp(layout.replace("/", "-").replace("+", "-"))
            spec = StackSpec(layout=layout, encoders=2, model=model_path, run_dir=run_dir, env=tracing_env(receiver))
            stack = Stack(spec)
            stack.up()
            started[layout] = stack
        return started[layout]

    yield get
    for stack in started.values():
        statuses = stack.down()
        assert all(code == 0 for code in statuses.values()), f"unclean exit: {statuses}"


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
