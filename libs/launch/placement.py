"""Where a stack's processes run on a small host: on which CPUs, at which priority.

On a host of a few cores every service shares them through the OS scheduler, and the engine that
steps the decoding batch waits whenever another process holds its core: each wait is a gap between
two tokens of every sequence in the batch. The plan for E+PD on vLLM (`StackSpec.placement`):

- the PD's engine (vLLM's EngineCore, `--engine-cpus`) alone on the host's last CPU;
- the router (with its door) and the PD service's own process (its gRPC front, vLLM's input
  processing, the token relay) on the other CPUs;
- the encoders on every CPU at the lowest priority (nice 19): they take what the others leave and
  give way at once, so the engine's core is theirs only while it idles;
- at most twice the PD's batch of requests inside the stack (the router's `--max-running`): one
  batch decoding, one being encoded and planned. The engine no longer being the bottleneck, more
  would only add their encoding, planning and input processing to the services' CPUs, where the
  running requests' tokens are relayed (measured: at 64 clients with no bound, 8-19 ms per token);
  the rest wait at the router, costing nothing.

Measured on 2 cores (docs/results/bench-vs-vllm.md, "The engine on a core of its own").
"""

from __future__ import annotations

import os
from collections.abc import Set
from dataclasses import dataclass

ENCODER_NICE = 19  # the lowest priority: an encoder runs where nothing else wants the core
PD_BATCH = 8  # the PD's `--max-batch` default (vLLM's max_num_seqs)


@dataclass(frozen=True)
class Placement:
    """CPUs and priority per role of an E+PD stack."""

    engine_cpus: frozenset[int]  # the PD's engine, alone
    service_cpus: frozenset[int]  # router, door, the PD service's own process
    encoder_nice: int = ENCODER_NICE  # the encoders, on every CPU
    pd_batch: int = PD_BATCH  # the router admits twice this

    @classmethod
    def for_host(cls, cpus: Set[int] | None = None) -> Placement:
        """The plan on these CPUs (default: those this process may run on); at least two."""
        cpus = frozenset(os.sched_getaffinity(0) if cpus is None else cpus)
        if len(cpus) < 2:
            raise ValueError(f"placement needs at least 2 CPUs (the engine's and the services'), got {sorted(cpus)}")
        engine = max(cpus)
        return cls(engine_cpus=frozenset({engine}), service_cpus=cpus - {engine})

    def cpus(self, role: str) -> frozenset[int] | None:
        """The CPUs of a process in `role` (encoder, pd, router, openai_door); None: every CPU."""
        return None if role == "encoder" else self.service_cpus

    def nice(self, role: str) -> int:
        return self.encoder_nice if role == "encoder" else 0

    def args(self, role: str) -> list[str]:
        """The service flags of the plan: the PD's engine CPUs, the router's bound."""
        if role == "pd":
            return ["--engine-cpus", ",".join(map(str, sorted(self.engine_cpus)))]
        if role == "router":
            return ["--max-running", str(2 * self.pd_batch)]
        return []
