"""Settings of a service that runs a language-model engine (PD, prefill, decode)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from libs.config import setting
from libs.serving.settings import ModelServiceSettings


@dataclasses.dataclass(frozen=True)
class EngineSettings(ModelServiceSettings):
    """A model service with a choice of engine."""

    engine: Literal["reference", "vllm"] = setting("reference", "engine: the reference runtime or vLLM")
    kv_cache_mib: int = setting(64, "vLLM: KV-cache memory, in MiB (explicit: vLLM would size it from RAM)")
    max_model_len: int = setting(4096, "vLLM: longest prompt + generation, in tokens")
    engine_start_timeout_s: float = setting(300.0, "vLLM: seconds an engine (re)start may take")
