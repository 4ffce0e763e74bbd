"""The settings a backend is started from: what its service's settings hold besides serving ones.
Each service's settings class derives from one of these (services/*/service.py)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from libs.config import setting
from libs.serving.settings import ChunkedPrefillSettings, ModelServiceSettings


@dataclasses.dataclass(frozen=True)
class EngineSettings(ModelServiceSettings):
    """A model service with a choice of engine (prefill, decode, PD)."""

    engine: Literal["reference", "vllm"] = setting("reference", "engine: the reference runtime or vLLM")
    kv_cache_mib: int = setting(64, "vLLM: KV-cache memory, in MiB (explicit: vLLM would size it from RAM)")
    max_model_len: int = setting(4096, "vLLM: longest prompt + generation, in tokens")
    engine_start_timeout_s: float = setting(300.0, "vLLM: seconds an engine (re)start may take")


@dataclasses.dataclass(frozen=True)
class ChunkedEngineSettings(ChunkedPrefillSettings, EngineSettings):
    """A service that prefills with a choice of engine (prefill, PD)."""


@dataclasses.dataclass(frozen=True)
class EncoderBackendSettings(ModelServiceSettings):
    """The encoder's backend (the reference runtime only): its output cache."""

    cache_mib: int = setting(256, "in-process encoder-output cache (LRU), in MiB; 0 disables caching")
    cache_master: str = setting("", "Mooncake Store master (HOST:PORT) shared by encoders; empty: local cache only")


@dataclasses.dataclass(frozen=True)
class ColocatedBackendSettings(ChunkedPrefillSettings, ModelServiceSettings):
    """The colocated service's backend (the reference runtime only)."""
