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
    kv_cache_mib: int = setting(
        64,
        "vLLM: KV-cache memory, in MiB (explicit: vLLM would size it from RAM); unused when "
        "--gpu-memory-utilization > 0",
    )
    gpu_memory_utilization: float = setting(
        0.0,
        "vLLM: fraction (0-1] of the device's memory the engine may take (weights, activations, KV cache), vLLM's "
        "own sizing; 0: the KV cache is --kv-cache-mib",
    )
    max_model_len: int = setting(4096, "vLLM: longest prompt + generation, in tokens")
    max_num_batched_tokens: int = setting(
        0, "vLLM: tokens one engine step computes at most (longer prompts are prefilled in chunks); 0: vLLM's default"
    )
    device: str = setting(
        "cpu",
        "vLLM: device the engine runs on (cpu, cuda, xpu, ...); the installed vLLM build must be that device's "
        "(docs/vllm-operations.md); KV buffers and embeddings land there",
    )
    dtype: str = setting(
        "float32", "vLLM: model dtype (float32, bfloat16, float16, auto); float32 matches the reference runtime"
    )
    enforce_eager: bool = setting(
        False,
        "vLLM: eager execution (a quicker start); off: vLLM compiles the language model, its own default (and "
        "captures CUDA graphs on GPUs): faster per token (docs/vllm-operations.md)",
    )
    tensor_parallel_size: int = setting(1, "vLLM: devices one engine shards the model over (tensor parallel)")
    engine_host_ip: str = setting(
        "",
        "vLLM: address peers reach this engine's NIXL side channel and agent at (VLLM_HOST_IP, "
        "VLLM_NIXL_SIDE_CHANNEL_HOST); empty: --host",
    )
    nixl_side_channel_port: int = setting(
        0, "vLLM: TCP port of the engine's NIXL side channel (KV handoffs); 0: a free port at every engine start"
    )
    distributed_executor_backend: Literal["auto", "uni", "mp"] = setting(
        "auto",
        "vLLM: where the engine's worker runs: uni (inside EngineCore: one process, and no polling between "
        "the two), mp (a Worker process of its own); auto: uni on CPU with --tensor-parallel-size 1 (vLLM's "
        "CPU build would spawn a Worker), else vLLM's own choice",
    )
    engine_busy_poll_s: float = setting(
        -1.0,
        "vLLM: seconds EngineCore and its Worker keep polling each other's queue after a message before they "
        "sleep (waking every 1 ms); -1: vLLM's own (1 s); 0: sleep at once (a host with few cores, where the "
        "polling takes the cores the forward needs)",
    )
    engine_cpus: tuple[int, ...] = setting(
        (),
        "vLLM: CPUs the engine's processes (EngineCore, and its Worker) run on, comma-separated (e.g. 1); the "
        "service itself keeps its own. Empty: the service's. On a host with few cores an engine on a core of its "
        "own steps without waiting behind the other services (docs/vllm-operations.md, Placement)",
    )
    engine_start_timeout_s: float = setting(
        300.0, "vLLM: seconds an engine (re)start may take; past it its processes are killed (a failure)"
    )
    engine_hang_timeout_s: float = setting(
        30.0,
        "vLLM: seconds an engine with work queued may make no progress (no output, no answer to a probe) "
        "before it is killed and restarted as hung; 0 disables the watchdog",
    )
    engine_max_restarts: int = setting(
        5, "vLLM: engine restarts allowed within --engine-restart-window-s; one more failure ends the service (exit 1)"
    )
    engine_restart_window_s: float = setting(600.0, "vLLM: the window --engine-max-restarts counts in, in seconds")
    engine_backoff_start_s: float = setting(1.0, "vLLM: wait before a first restart, in seconds (doubles per restart)")
    engine_backoff_max_s: float = setting(60.0, "vLLM: longest wait before a restart, in seconds")


@dataclasses.dataclass(frozen=True)
class ChunkedEngineSettings(ChunkedPrefillSettings, EngineSettings):
    """A service that prefills with a choice of engine (prefill, PD)."""


@dataclasses.dataclass(frozen=True)
class PrefillDecodeEngineSettings(ChunkedEngineSettings):
    """A service that prefills and decodes with a choice of engine (PD)."""

    prefill_chunk_fair_share: bool = setting(
        True,
        "vLLM: --prefill-chunk-tokens is a floor: a prompt may take a fair share of the step's token budget "
        "(max_num_batched_tokens / requests running or waiting) when that is more, so a few prompts prefill "
        "whole while many still go in chunks (vLLM's long_prefill_token_threshold_adaptive); "
        "--no-prefill-chunk-fair-share: every prompt in chunks of --prefill-chunk-tokens while others run or wait "
        "(as on the prefill service: there whole prompts cost the E/P/D split tokens/s)",
    )

    prefill_batch_steps: int = setting(
        16,
        "vLLM: engine steps between two rounds of new requests going in while the batch (--max-batch) is full: "
        "a request arriving then waits for the window's end or a free slot (at most this many steps of the "
        "running batch) and is prefilled with the others that arrived in it, so decoding sequences are stalled "
        "by prefills once per window; 0: every request goes in at once (vLLM's own behaviour)",
    )


@dataclasses.dataclass(frozen=True)
class EncoderBackendSettings(EngineSettings):
    """The encoder's backend: the reference runtime (its output cache) or vLLM encoder-only (the
    vLLM settings above; the cache settings are the reference's)."""

    # vLLM compiles no tower unless asked (compile_mm_encoder): compiling would only lengthen the start.
    enforce_eager: bool = setting(True, "vLLM: eager execution of the encoder's tower")
    cache_mib: int = setting(256, "in-process encoder-output cache (LRU), in MiB; 0 disables caching")
    cache_master: str = setting("", "Mooncake Store master (HOST:PORT) shared by encoders; empty: local cache only")
    encode_batch_items: int = setting(
        16,
        "most media items one tower forward takes: reference, from Encode calls that queued while the last one "
        "ran (images only: videos and audio run per call; 1: one call per forward); vLLM, its max_num_seqs: the "
        "Encode calls one step takes (one vLLM request per call)",
    )


@dataclasses.dataclass(frozen=True)
class ColocatedBackendSettings(ChunkedPrefillSettings, ModelServiceSettings):
    """The colocated service's backend (the reference runtime only)."""
