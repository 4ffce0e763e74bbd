"""The P4 benchmark's baseline stack (docs/results/experiments.md) against real services: its router
and prefill run through the bench-only wrapper (tests/benchmarks/raw_media.py), so prefill gets each
item's raw media besides the metadata, decodes and preprocesses it, and still serves the model's own
tokens; the stacks of every other test run the services without it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from libs.launch.stack import Stack, StackSpec
from libs.telemetry.spans import OtlpReceiver
from tests.support.golden import request_for
from tests.support.stacks import MIXES, run_requests, wait_for, wait_pools_empty
from tests.support.tracing import tracing_env

pytestmark = pytest.mark.stack


@pytest.fixture(scope="module")
def baseline(model_path: Path, tmp_path_factory: pytest.TempPathFactory, receiver: OtlpReceiver) -> Iterator[Stack]:
    spec = StackSpec(
        layout="e/p/d",
        encoders=1,
        model=model_path,
        run_dir=tmp_path_factory.mktemp("p4-baseline"),
        env=tracing_env(receiver),
        run_through={side: ["tests.benchmarks.raw_media", f"--{side}"] for side in ("router", "prefill")},
    )
    stack = Stack(spec)
    stack.up()
    yield stack
    stack.down()


@pytest.mark.slow  # a stack of its own
@pytest.mark.timeout(300)
def test_the_raw_media_baseline_preprocesses_at_prefill_and_serves_the_models_tokens(
    baseline: Stack, expected: dict[str, list[int]], receiver: OtlpReceiver
) -> None:
    names = ["image", "two_images", "audio_image"]
    requests = [request_for(MIXES[name], request_id=f"p4-baseline-{name}") for name in names]
    results = run_requests(baseline.address, requests)
    assert [r.token_ids for r in results] == [expected[name] for name in names]

    def preprocessed() -> list[int]:
        return [
            int(s.attributes.get("items", 0))
            for s in receiver.snapshot()
            if s.name == "prefill.raw_media" and s.service == "prefill"
        ]

    # One preprocess stage per request, over all its items (only this stack's prefill has one).
    wait_for(lambda: len(preprocessed()) >= len(names), 30, "the baseline prefill's preprocess spans")
    assert sorted(preprocessed()) == sorted(len(MIXES[name].media) for name in names)
    wait_pools_empty(baseline)
