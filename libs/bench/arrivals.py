"""Arrival processes: open-loop Poisson (arrival times fixed in advance, whatever the server does)
and the bounds of a run (count and duration)."""

from __future__ import annotations

import random


def poisson_arrivals(rate_per_s: float, *, count: int, duration_s: float, seed: int = 0) -> list[float]:
    """Arrival instants (seconds from the start) of a Poisson process of `rate_per_s`: exponential
    gaps, at most `count` arrivals, none at or after `duration_s`."""
    if rate_per_s <= 0:
        raise ValueError("rate must be > 0")
    if count < 0 or duration_s <= 0:
        raise ValueError("count must be >= 0 and duration > 0")
    rng = random.Random(seed)
    out: list[float] = []
    t = 0.0
    while len(out) < count:
        t += rng.expovariate(rate_per_s)
        if t >= duration_s:
            break
        out.append(t)
    return out
