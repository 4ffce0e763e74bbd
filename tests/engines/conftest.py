"""vLLM engine fixtures: one real stack per layout, started once per test session and reused
(a vLLM engine takes 30-50 s and ~1.5 GB to start on 2 cores)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from libs.engine.checkpoints import ensure_checkpoint
from libs.launch.stack import Stack, StackSpec


@pytest.fixture(scope="session")
def omni_tiny() -> Path:
    return ensure_checkpoint("qwen2_5_omni", "tiny")


@pytest.fixture(scope="session")
def vllm_epd_stack(omni_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """E+PD: a reference encoder and a PD service on vLLM, behind the router; each its own process."""
    spec = StackSpec(
        layout="e+pd",
        encoders=1,
        model=omni_tiny,
        run_dir=tmp_path_factory.mktemp("vllm-e+pd"),
        engine="vllm",
        ready_timeout_s=420.0,
    )
    with Stack(spec).running() as stack:
        yield stack
