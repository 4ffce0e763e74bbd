"""Which engine a service runs, as advertised in `ServiceInfo.capabilities` (`engine.<name>`).
Torch-free: the router checks engine pairs at first contact without loading a model runtime."""

from __future__ import annotations

from collections.abc import Iterable

from libs.contract.epd.v1 import service_info_pb2

ENGINES = ("reference", "vllm")
CAPABILITY_PREFIX = "engine."
# Contract 1.3: prefill fills `KvCache.paged` (the KV stays in its engine's blocks) and decode reads
# it; advertised by both vLLM services.
PAGED_KV = "kv.paged_blocks"


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
