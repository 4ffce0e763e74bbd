"""A discrete-event model (SimPy) of a disaggregated stack, driven by a measured `Profile`.

Each instance is one engine thread (a priority queue, as `libs.serving.compute_thread.ComputeThread`):
- an encoder runs one item at a time (items of a request spread over the least-loaded encoders);
- a prefill (E/P/D) or PD (E+PD) instance runs prefill in chunks of `chunk_tokens`, each queued by
  its remaining tokens (shortest remaining first); a PD instance also runs its decode batch, one
  step at priority 0 whenever sequences are active; an E/P/D decode instance runs only steps;
- a decode step for a batch of b costs what the profile measured (`Profile.step_cost`: a line in
  b fitted to the engine time of measured steps), else `step_s * (1 + batch_cost * (b - 1))`;
- prefill chunks are the measured services' (`Profile.chunk_tokens`) unless given;
- hops, bookkeeping and transfers are a fixed delay per request (sampled with it), before its first
  token.
A request is one measured request of its kind, resampled: its items' encode times, its prefill time
and tokens, its output length. Arrivals are Poisson (open loop) or N clients (closed loop).
"""

from __future__ import annotations

import math
import random
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

import simpy

from libs.bench.histogram import LatencyHistogram
from libs.plan.profile import Profile, RequestProfile

Proc = Generator[Any, Any, None]


@dataclass(frozen=True)
class Layout:
    kind: str  # "e+pd" or "e/p/d"
    encoders: int = 1
    prefill: int = 1  # PD instances for e+pd
    decode: int = 1  # e/p/d only

    def total(self) -> int:
        return self.encoders + self.prefill + (self.decode if self.kind == "e/p/d" else 0)

    def describe(self) -> str:
        if self.kind == "e+pd":
            return f"{self.encoders} E + {self.prefill} PD"
        return f"{self.encoders} E + {self.prefill} P + {self.decode} D"


@dataclass(frozen=True)
class Workload:
    mix: dict[str, float]  # kind -> share
    rate_per_s: float = 0.0  # open loop when > 0
    clients: int = 0  # closed loop when > 0
    duration_s: float = 300.0
    max_tokens: int = 8  # output tokens cap (measured lengths are capped to it)
    images: int = 0  # image requests resample measured ones with this many items (0: any)


@dataclass
class SimResult:
    ttft: dict[str, LatencyHistogram] = field(default_factory=dict)  # by kind, and "all"
    completed: int = 0
    window_s: float = 0.0

    def p90(self, kind: str = "all") -> float:
        hist = self.ttft.get(kind)
        return hist.percentile(90) if hist is not None else math.nan

    def throughput(self) -> float:
        return self.completed / self.window_s if self.window_s > 0 else 0.0


class _Engine:
    """One engine thread; `busy` counts queued + running jobs (for least-loaded placement)."""

    def __init__(self, env: simpy.Environment) -> None:
        self.env = env
        self.thread = simpy.PriorityResource(env, capacity=1)
        self.outstanding = 0
        self.active: dict[int, list[Any]] = {}  # decode batch: request id -> [tokens left, done event]
        self.wake = env.event()

    def run(self, seconds: float, priority: int) -> Proc:
        self.outstanding += 1
        with self.thread.request(priority=priority) as turn:
            yield turn
            yield self.env.timeout(seconds)
        self.outstanding -= 1


class Simulation:
    def __init__(
        self,
        profile: Profile,
        layout: Layout,
        *,
        chunk_tokens: int | None = None,
        batch_cost: float = 0.08,
        seed: int = 0,
    ) -> None:
        self.profile = profile
        self.layout = layout
        self.chunk_tokens = chunk_tokens or profile.chunk_tokens
        self.batch_cost = batch_cost
        self.step_s = profile.decode_step_s()
        self.step_fit = profile.step_cost()
        self.rng = random.Random(seed)
        self.env = simpy.Environment()
        self.encoders = [_Engine(self.env) for _ in range(layout.encoders)]
        self.lm = [_Engine(self.env) for _ in range(layout.prefill)]
        self.decoders = [_Engine(self.env) for _ in range(layout.decode)] if layout.kind == "e/p/d" else self.lm
        for engine in self.decoders:
            self.env.process(self._decode_loop(engine))
        self._ids = 0
        self._images = 0

    # --- the request ---------------------------------------------------------------------------

    def _sample(self, mix: dict[str, float]) -> RequestProfile:
        kinds = [k for k in mix if mix[k] > 0 and self.profile.of_kind(k)]
        if not kinds:
            raise ValueError(f"no measured requests of any kind in the mix {mix}")
        kind = self.rng.choices(kinds, weights=[mix[k] for k in kinds])[0]
        pool = self.profile.of_kind(kind)
        if kind == "image" and self._images:
            pool = [r for r in pool if r.items == self._images] or pool
        return self.rng.choice(pool)

    def _request(self, req: RequestProfile, max_tokens: int, result: SimResult, t_end: float) -> Proc:
        env = self.env
        start = env.now
        if req.encode_s:
            jobs = []
            for seconds in req.encode_s:
                encoder = min(self.encoders, key=lambda e: e.outstanding)
                jobs.append(env.process(encoder.run(seconds, 0)))
            yield env.all_of(jobs)
        lm = min(self.lm, key=lambda e: e.outstanding)
        chunks = max(1, math.ceil(req.prompt_tokens / self.chunk_tokens))
        per_chunk = req.prefill_s / chunks
        remaining = req.prompt_tokens
        for _ in range(chunks):
            yield env.process(lm.run(per_chunk, max(1, remaining)))
            remaining -= self.chunk_tokens
        yield env.timeout(req.fixed_s)
        if start < t_end:  # measured: started inside the window
            ttft = env.now - start
            result.ttft.setdefault(req.kind, LatencyHistogram()).record(ttft)
            result.ttft.setdefault("all", LatencyHistogram()).record(ttft)
        tokens = min(max_tokens, max(1, req.output_tokens)) - 1
        if tokens > 0:
            decoder = min(self.decoders, key=lambda e: len(e.active))
            done = env.event()
            self._ids += 1
            decoder.active[self._ids] = [tokens, done]
            if not decoder.wake.triggered:
                decoder.wake.succeed()
            yield done
        if start < t_end:
            result.completed += 1

    def _decode_loop(self, engine: _Engine) -> Proc:
        while True:
            if not engine.active:
                engine.wake = self.env.event()
                yield engine.wake
            yield self.env.process(engine.run(self._step_cost(len(engine.active)), 0))
            for rid in list(engine.active):
                left, done = engine.active[rid]
                if left <= 1:
                    del engine.active[rid]
                    done.succeed()
                else:
                    engine.active[rid][0] = left - 1

    def _step_cost(self, batch: int) -> float:
        if self.step_fit is not None:
            base, per_sequence = self.step_fit
            return base + per_sequence * batch
        return self.step_s * (1 + self.batch_cost * (batch - 1))

    # --- arrivals ------------------------------------------------------------------------------

    def run(self, workload: Workload) -> SimResult:
        result = SimResult(window_s=workload.duration_s)
        self._images = workload.images
        t_end = workload.duration_s
        if workload.clients > 0:
            for _ in range(workload.clients):
                self.env.process(self._client(workload, result, t_end))
        else:
            self.env.process(self._arrivals(workload, result, t_end))
        self.env.run(until=t_end * 1.5 + 60)  # let started requests finish; queues past this are dropped
        return result

    def _client(self, workload: Workload, result: SimResult, t_end: float) -> Proc:
        while self.env.now < t_end:
            yield self.env.process(self._request(self._sample(workload.mix), workload.max_tokens, result, t_end))

    def _arrivals(self, workload: Workload, result: SimResult, t_end: float) -> Proc:
        while self.env.now < t_end:
            yield self.env.timeout(self.rng.expovariate(workload.rate_per_s))
            self.env.process(self._request(self._sample(workload.mix), workload.max_tokens, result, t_end))


def simulate(profile: Profile, layout: Layout, workload: Workload, *, seed: int = 0, **kwargs: Any) -> SimResult:
    return Simulation(profile, layout, seed=seed, **kwargs).run(workload)


def recommend(
    profile: Profile, kind: str, workload: Workload, slo_ttft_s: float, *, max_instances: int = 16, seed: int = 0
) -> tuple[Layout, SimResult] | None:
    """The layout with the fewest instances (then the lowest p90) whose predicted p90 TTFT meets
    the SLO and whose throughput keeps up with the arrival rate; None if none within the bound."""
    best: tuple[Layout, SimResult] | None = None
    for total in range(2 if kind == "e+pd" else 3, max_instances + 1):
        for e in range(1, total):
            rest = total - e
            options = (
                [Layout(kind, e, rest)] if kind == "e+pd" else [Layout(kind, e, p, rest - p) for p in range(1, rest)]
            )
            for layout in options:
                result = simulate(profile, layout, workload, seed=seed)
                keeps_up = workload.rate_per_s <= 0 or result.throughput() >= 0.95 * workload.rate_per_s
                if keeps_up and result.p90() <= slo_ttft_s and (best is None or result.p90() < best[1].p90()):
                    best = (layout, result)
        if best is not None:
            return best
    return None
