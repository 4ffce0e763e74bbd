"""In-process engines of the tiny checkpoints: one family's checkpoint, runners and reference
model, each built on first use (the tests/runtime fixtures hand out one `Engines` per family)."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from libs.model.checkpoints import ensure_checkpoint
from libs.runtime.encoder_runner import EncoderRunner
from libs.runtime.lm_runtime import LanguageModelRuntime
from libs.runtime.prefill_runner import PrefillRunner
from tests.support.reference import load_reference

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
