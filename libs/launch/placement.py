"""Where a stack's processes run on a small host: on which CPUs, at which priority.

On a host of a few cores every service shares them through the OS scheduler, and the engine that
steps the decoding batch waits whenever another process holds its core: each wait is a gap between
two tokens of every sequence in the batch. The plan for a disaggregated stack on vLLM
(`StackSpec.placement`):

- the engine that decodes (vLLM's EngineCore, `--engine-cpus`: the PD's in E+PD, the decode's in
  E/P/D) alone on the host's last CPU;
- the router (with its door), that service's own process (its gRPC front, vLLM's input processing,
  the token relay) and, in E/P/D, the prefill service with its engine on the other CPUs;
- the encoders on every CPU at the lowest priority (nice 19, their session's too: `process.py`,
  `set_session_nice`): they take what the others leave and give way at once, so the engine's core
  is theirs only while it idles. The session's nice matters, not only the process's: the kernel's
  session groups share CPU between sessions regardless of each process's own nice;
- at most `ADMITTED_BATCHES` times the decoding engine's batch of requests inside the stack (the
  router's `--max-running`): one batch decoding, the others being encoded, planned (and in E/P/D
  prefilled). With encoders that give way, the deeper queue keeps their lower-priority work going
  while the engine decodes; the rest wait at the router, costing nothing.

What each choice bought, and the depths tried: docs/results/bench-vs-vllm.md.
"""

from __future__ import annotations

import os
from collections.abc import Set
from dataclasses import dataclass

ENCODER_NICE = 19  # the lowest priority: an encoder runs where nothing else wants the core
BATCH = 8  # the PD's and the decode's `--max-batch` default (vLLM's max_num_seqs)
ADMITTED_BATCHES = 4  # requests inside the stack, in decoding batches (the router's `--max-running`)
DECODING_ROLE = {"e+pd": "pd", "e/p/d": "decode"}  # per layout, the service whose engine decodes


@dataclass(frozen=True)
class Placement:
    """CPUs and priority per role of a disaggregated stack."""

    engine_cpus: frozenset[int]  # the decoding engine, alone
    service_cpus: frozenset[int]  # every other process but the encoders
    decoding_role: str = "pd"  # the service whose engine decodes: pd (E+PD) or decode (E/P/D)
    encoder_nice: int = ENCODER_NICE  # the encoders, on every CPU
    batch: int = BATCH  # the decoding engine's; the router admits ADMITTED_BATCHES of these

    @classmethod
    def for_host(cls, cpus: Set[int] | None = None, layout: str = "e+pd") -> Placement:
        """The plan for `layout` (e+pd, e/p/d) on these CPUs (default: those this process may run on);
        at least two."""
        if layout not in DECODING_ROLE:
            raise ValueError(f"placement is planned for the e+pd and e/p/d layouts, not {layout!r}")
        cpus = frozenset(os.sched_getaffinity(0) if cpus is None else cpus)
        if len(cpus) < 2:
            raise ValueError(f"placement needs at least 2 CPUs (the engine's and the services'), got {sorted(cpus)}")
        engine = max(cpus)
        return cls(engine_cpus=frozenset({engine}), service_cpus=cpus - {engine}, decoding_role=DECODING_ROLE[layout])

    def cpus(self, role: str) -> frozenset[int] | None:
        """The CPUs of a process in `role` (encoder, pd, prefill, decode, router, openai_door); None: every CPU."""
        return None if role == "encoder" else self.service_cpus

    def nice(self, role: str) -> int:
        return self.encoder_nice if role == "encoder" else 0

    def args(self, role: str) -> list[str]:
        """The service flags of the plan: the decoding engine's CPUs, the router's bound."""
        if role == self.decoding_role:
            return ["--engine-cpus", ",".join(map(str, sorted(self.engine_cpus)))]
        if role == "router":
            return ["--max-running", str(ADMITTED_BATCHES * self.batch)]
        return []
