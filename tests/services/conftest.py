"""Service-level fixtures: real stacks (one process per service, loopback gRPC), started once per
test session per layout and stopped by PID at the end, and the colocated model's reference.

Every session stack exports its spans over OTLP/gRPC to one real receiver in this process
(`receiver`), so a test can check what the services did, not only what the client saw: send a call
with a trace id of its own (`tests.support.tracing.traced()`) and read that trace's spans
(`trace_spans()`). Helpers for stacks (requests, stats, empty pools): tests/support/stacks.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from libs.launch.stack import Stack, StackSpec
from libs.model.checkpoints import ensure_checkpoint
from libs.runtime.encoder_runner import EncoderRunner
from libs.runtime.lm_runtime import LanguageModelRuntime
from libs.telemetry.spans import OtlpReceiver
from tests.support.golden import expected_tokens
from tests.support.reference import load_reference
from tests.support.stacks import MIXES
from tests.support.tracing import tracing_env


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
