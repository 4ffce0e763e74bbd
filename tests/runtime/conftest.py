"""Fixtures of the engine tests: one `Engines` (tests/support/engines.py) per family, and the Omni
tiny checkpoint's runners and reference model."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from libs.runtime.decode_runner import DecodeRunner
from libs.runtime.encoder_runner import EncoderRunner
from libs.runtime.lm_runtime import LanguageModelRuntime
from libs.runtime.prefill_runner import PrefillRunner
from tests.support.engines import Engines


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
