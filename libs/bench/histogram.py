"""An HDR-style latency histogram: log-linear buckets with a fixed relative precision.

Values (seconds) are recorded as integer microseconds into buckets whose width is at most
1 / 2**`precision_bits` of their lower edge (precision_bits=7: < 0.8 % error), from 1 us to ~1 hour
in a few thousand buckets, so recording is O(1) and memory is bounded however many values arrive.
Percentiles are read from bucket upper edges, clamped to the exact min and max seen.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class LatencyHistogram:
    precision_bits: int = 7
    counts: dict[int, int] = field(default_factory=dict)  # bucket index -> count
    total: int = 0
    min_s: float = math.inf
    max_s: float = 0.0
    sum_s: float = 0.0

    def _index(self, micros: int) -> int:
        sub = 1 << self.precision_bits
        if micros < sub:
            return micros  # exact below 2**bits us
        exponent = micros.bit_length() - self.precision_bits - 1
        return sub + exponent * sub + ((micros >> exponent) - sub)

    def _upper_edge_us(self, index: int) -> int:
        sub = 1 << self.precision_bits
        if index < sub:
            return index
        exponent, offset = divmod(index - sub, sub)
        return ((sub + offset + 1) << exponent) - 1

    def record(self, seconds: float) -> None:
        if seconds < 0 or math.isnan(seconds):
            raise ValueError(f"latency must be >= 0, got {seconds}")
        index = self._index(round(seconds * 1e6))
        self.counts[index] = self.counts.get(index, 0) + 1
        self.total += 1
        self.min_s = min(self.min_s, seconds)
        self.max_s = max(self.max_s, seconds)
        self.sum_s += seconds

    def record_all(self, values: Iterable[float]) -> LatencyHistogram:
        for value in values:
            self.record(value)
        return self

    def percentile(self, q: float) -> float:
        """The smallest recorded bucket edge with at least q % of the values at or below it."""
        if not 0 <= q <= 100:
            raise ValueError(f"percentile must be in [0, 100], got {q}")
        if self.total == 0:
            return math.nan
        if q == 0:
            return self.min_s
        rank = max(1, math.ceil(q / 100 * self.total))
        seen = 0
        for index in sorted(self.counts):
            seen += self.counts[index]
            if seen >= rank:
                return min(self.max_s, max(self.min_s, self._upper_edge_us(index) / 1e6))
        return self.max_s

    @property
    def mean_s(self) -> float:
        return self.sum_s / self.total if self.total else math.nan

    def summary(self) -> dict[str, float]:
        """count, mean, min, p50, p90, p99, max (seconds)."""
        return {
            "count": self.total,
            "mean_s": self.mean_s,
            "min_s": self.min_s if self.total else math.nan,
            "p50_s": self.percentile(50),
            "p90_s": self.percentile(90),
            "p99_s": self.percentile(99),
            "max_s": self.max_s if self.total else math.nan,
        }
