from __future__ import annotations

from collections.abc import Iterator
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


@pytest.fixture(scope="session")
def omni_path() -> Path:
    return ensure_checkpoint("qwen2_5_omni", "tiny")


@pytest.fixture(scope="session")
def omni_encoder(omni_path: Path) -> EncoderRunner:
    return EncoderRunner(omni_path)


@pytest.fixture(scope="session")
def omni_runtime(omni_path: Path) -> LanguageModelRuntime:
    return LanguageModelRuntime(omni_path)


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
def omni_reference(omni_path: Path) -> Any:
    torch.manual_seed(0)
    return load_reference(str(omni_path))
