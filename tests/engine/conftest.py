from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import cached_property
from pathlib import Path
from typing import Any

import pytest
import torch

from libs.engine.checkpoints import ensure_checkpoint
from libs.engine.decode_runner import DecodeRunner
from libs.engine.encoder_runner import EncoderRunner
from libs.engine.lm_runtime import LanguageModelRuntime
from libs.engine.prefill_runner import PrefillRunner
from tests.engine.reference import load_reference

FAMILIES = ("qwen2_5_omni", "qwen2_5_vl", "qwen3_vl")


class Engines:
    """One family's tiny checkpoint and in-process runners, built on first use."""

    def __init__(self, family: str) -> None:
        self.family = family

    @cached_property
    def path(self) -> Path:
        return ensure_checkpoint(self.family, "tiny")

    @cached_property
    def encoder(self) -> EncoderRunner:
        return EncoderRunner(self.path)

    @cached_property
    def runtime(self) -> LanguageModelRuntime:
        return LanguageModelRuntime(self.path)

    @cached_property
    def prefill(self) -> PrefillRunner:
        return PrefillRunner(self.runtime)

    @cached_property
    def reference(self) -> Any:
        torch.manual_seed(0)
        return load_reference(str(self.path))


@pytest.fixture(scope="session")
def engines() -> Callable[[str], Engines]:
    cache: dict[str, Engines] = {}
    return lambda family: cache.setdefault(family, Engines(family))


@pytest.fixture(scope="session")
def omni_path(engines: Callable[[str], Engines]) -> Path:
    return engines("qwen2_5_omni").path


@pytest.fixture(scope="session")
def omni_encoder(engines: Callable[[str], Engines]) -> EncoderRunner:
    return engines("qwen2_5_omni").encoder


@pytest.fixture(scope="session")
def omni_runtime(engines: Callable[[str], Engines]) -> LanguageModelRuntime:
    return engines("qwen2_5_omni").runtime


@pytest.fixture
def omni_prefill(omni_runtime: LanguageModelRuntime) -> PrefillRunner:
    return PrefillRunner(omni_runtime)


@pytest.fixture
def omni_decode(omni_runtime: LanguageModelRuntime) -> Iterator[DecodeRunner]:
    runner = DecodeRunner(omni_runtime)
    yield runner
    for request_id in runner.active_ids:
        runner.cancel(request_id)


@pytest.fixture(scope="session")
def omni_reference(engines: Callable[[str], Engines]) -> Any:
    return engines("qwen2_5_omni").reference
