"""vLLM engine fixtures: one real stack per layout, started once per test session and reused
(a vLLM engine is slow and heavy to start). One module uses each layout's
stack, so module scope starts each once and stops it before the next layout's engines start."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from libs.launch.stack import Stack, StackSpec
from libs.model.checkpoints import ensure_checkpoint
from tests.support.vllm_stack import CHUNKED_PREFILL_TOKENS
from tests.support.vllm_unsplit import unsplit_tokens


@pytest.fixture(scope="session")
def omni_tiny() -> Path:
    return ensure_checkpoint("qwen2_5_omni", "tiny")


@pytest.fixture(scope="session")
def vllm_unsplit() -> Callable[[Path, str], dict[str, list[int] | str]]:
    """vLLM's own unsplit tokens for every mix of a checkpoint's family, one child run per family
    per session (tests/support/vllm_unsplit.py)."""
    return functools.cache(unsplit_tokens)


@pytest.fixture(scope="module")
def vllm_epd_stack(omni_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """E+PD: a reference encoder and a PD service on vLLM, behind the router; each its own process."""
    spec = StackSpec(
        layout="e+pd",
        encoders=1,
        model=omni_tiny,
        run_dir=tmp_path_factory.mktemp("vllm-e+pd"),
        engine="vllm",
        # --grace-s: the drain test's streams finish within it. Chunks of 16 prompt tokens: requests
        # served together prefill their multimodal prompts in several steps, across the items.
        # --lease-ttl-s: the drain test's embeddings wait for a stopped engine (frozen_engine).
        # --engine-hang-timeout-s: the drain test stops the engine (frozen_engine) on purpose, for
        # as long as a loaded host needs; the watchdog must not take that for a hang.
        # --max-num-batched-tokens: a lone multimodal prompt is chunked too (CHUNKED_PREFILL_TOKENS).
        # --ucx-tls tcp: a READ needs the encoder's progress (no cross-memory attach), so the
        # slow-read test's stopped encoder holds a READ in flight for as long as the test needs.
        extra_args={
            "pd": [
                *("--grace-s", "120", "--prefill-chunk-tokens", "16", "--engine-hang-timeout-s", "600"),
                *("--max-num-batched-tokens", str(CHUNKED_PREFILL_TOKENS), "--ucx-tls", "tcp"),
            ],
            "encoder-0": ["--lease-ttl-s", "300", "--ucx-tls", "tcp"],
        },
        ready_timeout_s=420.0,
    )
    with Stack(spec).running() as stack:
        yield stack


@pytest.fixture(scope="module")
def vllm_split_stack(omni_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """E/P/D: a reference encoder, prefill and decode each on vLLM (KV moved by vLLM's NixlConnector
    through the project's subclass), behind the router; each its own process. Prefill's step budget
    is 32 tokens (`CHUNKED_PREFILL_TOKENS`): every multimodal prompt is prefilled in chunks. Placed
    on the host where it has 2 CPUs (libs/launch/placement.py): the decode's engine alone on one."""
    spec = StackSpec(
        layout="e/p/d",
        encoders=1,
        model=omni_tiny,
        run_dir=tmp_path_factory.mktemp("vllm-e-p-d"),
        engine="vllm",
        ready_timeout_s=600.0,
        extra_args={"prefill": ["--max-num-batched-tokens", str(CHUNKED_PREFILL_TOKENS)]},
        placement=len(os.sched_getaffinity(0)) >= 2,
    )
    with Stack(spec).running() as stack:
        yield stack
