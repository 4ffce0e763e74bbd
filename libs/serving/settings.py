"""Settings shared by the services that load a model (encoder, prefill, decode, PD, colocated)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from libs.config import CommonSettings, setting


@dataclasses.dataclass(frozen=True)
class ModelServiceSettings(CommonSettings):
    """Settings of a model-serving process."""

    model: Path = setting(Path("var/models/qwen2_5_omni-tiny"), "checkpoint directory (safetensors + config)")
    model_id: str = setting("", "model id to advertise; default: the checkpoint directory's name")
    revision: str = setting("local", "checkpoint revision to advertise")
    torch_threads: int = setting(1, "intra-op threads for model code (one process per core is typical)")
    max_running: int = setting(16, "requests in progress at once")
    max_waiting: int = setting(64, "requests waiting for a slot before RESOURCE_EXHAUSTED")
    max_batch: int = setting(8, "sequences decoded together in one step")
    grace_s: float = setting(10.0, "seconds in-flight requests get on shutdown")
    file_root: Path | None = setting(None, "directory file:// media URIs may read from; unset disables them")
    pool_mib: int = setting(256, "registered tensor pool, in MiB")
    lease_ttl_s: float = setting(30.0, "seconds tensors held for a consumer are kept if never read")
    checksum: bool = setting(
        True, "attach and verify a CRC32 per transferred tensor (catches reads of reclaimed slots)"
    )
    poison_freed: bool = setting(True, "overwrite freed slots, so a read of a reclaimed slot fails its checksum")
    accept_inline_tensors: bool = setting(
        False, "accept tensor bytes inside requests (INLINE handles) from unauthenticated callers; always with TLS"
    )
    ucx_net_devices: str = setting(
        "lo", "UCX_NET_DEVICES of the NIXL agent: the interface(s) tensors cross (lo: this host only; all: any)"
    )
    ucx_tls: str = setting(
        "", "UCX_TLS of the NIXL agent, e.g. tcp (no shared memory or cross-memory attach); empty: UCX chooses"
    )


@dataclasses.dataclass(frozen=True)
class ChunkedPrefillSettings:
    """Settings of a service that prefills (prefill, PD, colocated)."""

    prefill_chunk_tokens: int = setting(
        64,
        "prompt tokens per prefill forward (reference engine) or, on vLLM, per step of one prompt while other "
        "requests run or wait (long_prefill_token_threshold): a text request waits at most one chunk of a long "
        "(multimodal) prompt, short next to the whole prompt",
    )
    prefix_cache_mib: int = setting(
        256,
        "reference engine: MiB of prompt KV kept for later prompts that start the same way (a conversation's next "
        "turn, its images included), scoped by the request's cache_salt; 0 disables it (vLLM engines keep their own)",
    )
