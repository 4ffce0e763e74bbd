"""Which engine a service runs, as advertised in `ServiceInfo.capabilities` (`engine.<name>`).
Torch-free: the router checks engine pairs at first contact without loading a model runtime."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from libs.contract.epd.v1 import service_info_pb2

ENGINES = ("reference", "vllm")
CAPABILITY_PREFIX = "engine."
# Contract 1.3: prefill fills `KvCache.paged` (the KV stays in its engine's blocks) and decode reads
# it; advertised by both vLLM services.
PAGED_KV = "kv.paged_blocks"
# Checkpoint families (config.json's model_type) an engine serves only in some layouts, and why
# not in the others: refused when the service starts (libs/backends/vllm) and by `epd up`'s
# checks (libs/launch), naming the pair.
LAYOUTS_ONLY: dict[tuple[str, str], tuple[tuple[str, ...], str]] = {
    ("vllm", "whisper"): (
        ("e+pd",),
        "vLLM 0.32 takes no KV connector for encoder-decoder models (its scheduler asserts it), so Whisper's "
        "prefill and decode cannot be split on vLLM; serve it in the e+pd layout (a vLLM PD service) or on "
        "the reference engine",
    ),
}


# Checkpoint families whose towers vLLM runs encoder-only here (the encoder on `--engine vllm`),
# and those it cannot, with why: refused at the encoder's start-up and by `epd up`'s checks.
VLLM_ENCODER_FAMILIES = ("qwen2_5_vl", "qwen3_vl")
VLLM_ENCODER_REFUSED = {
    "whisper": "vLLM 0.32 runs Whisper's tower only inside its encoder-decoder model (no encoder-only mode); "
    "run Whisper's encoder on the reference engine",
    "qwen2_5_omni": "vLLM 0.32's CPU worker crashes running the tiny Qwen2.5-Omni towers (/work/shared/vllm.md); "
    "run its encoders on the reference engine",
}


def encoder_refusal(model: Path) -> str | None:
    """Why the encoder must not run `model` on vLLM (a family vLLM's tower cannot serve here), or
    None; a checkpoint that cannot be read here (a pod's path) is left to the service."""
    family = model_type(model)
    if not family:
        return None
    if family in VLLM_ENCODER_REFUSED:
        return f"a vLLM encoder for a {family} checkpoint is refused: {VLLM_ENCODER_REFUSED[family]}"
    if family not in VLLM_ENCODER_FAMILIES:
        return f"a vLLM encoder runs {', '.join(VLLM_ENCODER_FAMILIES)} checkpoints, not {family}"
    return None


def model_type(model: Path) -> str:
    """config.json's model_type of a checkpoint directory; empty when it cannot be read (a path
    that exists only where the service runs, e.g. in a pod)."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return ""
    return str(config.get("model_type", "")) if isinstance(config, dict) else ""


def refusal(engine: str, family: str, layout: str) -> str | None:
    """Why `engine` must not serve a checkpoint of `family` (model_type) in `layout`, or None."""
    rule = LAYOUTS_ONLY.get((engine, family))
    if rule is None or layout in rule[0]:
        return None
    return f"--engine {engine} with a {family} checkpoint is refused in the {layout} layout: {rule[1]}"


def capability(engine: str) -> str:
    """The capability string a service running `engine` advertises."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; expected one of {', '.join(ENGINES)}")
    return CAPABILITY_PREFIX + engine


def engine_of(info: service_info_pb2.ServiceInfo) -> str:
    """The engine a peer advertises; peers from before engines were advertised ran the reference."""
    names = [c.removeprefix(CAPABILITY_PREFIX) for c in info.capabilities if c.startswith(CAPABILITY_PREFIX)]
    return names[0] if names else "reference"


def engine_capabilities(engine: str, others: Iterable[str]) -> list[str]:
    return [*others, capability(engine)]
