"""From per-request records to a summary: latency percentiles (HDR-style histograms), throughput,
and goodput: requests per second that finished and met the SLO (TTFT and mean inter-token limits)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from libs.bench.histogram import LatencyHistogram


@dataclass(frozen=True)
class Slo:
    ttft_s: float = math.inf
    itl_s: float = math.inf  # mean inter-token latency of a request

    def met(self, record: RequestRecord) -> bool:
        return record.ok and record.ttft_s <= self.ttft_s and record.mean_itl_s <= self.itl_s


@dataclass
class RequestRecord:
    """One request as the client saw it (times in seconds; `start_s` from the run's start)."""

    kind: str
    start_s: float
    ttft_s: float = math.nan
    e2e_s: float = math.nan
    token_gaps_s: list[float] = field(default_factory=list)  # between successive token chunks
    tokens: int = 0
    error: str = ""
    request_id: str = ""
    trace_id: str = ""  # 32 hex digits when the client traced the request (joins the servers' spans)

    @property
    def ok(self) -> bool:
        return not self.error and not math.isnan(self.ttft_s)

    @property
    def mean_itl_s(self) -> float:
        return sum(self.token_gaps_s) / len(self.token_gaps_s) if self.token_gaps_s else 0.0

    @property
    def end_s(self) -> float:
        return self.start_s + (self.e2e_s if not math.isnan(self.e2e_s) else 0.0)


def window_s(records: Sequence[RequestRecord]) -> float:
    """From the first start to the last end among `records` (the measured window)."""
    if not records:
        return 0.0
    return max(r.end_s for r in records) - min(r.start_s for r in records)


def summarize(records: Sequence[RequestRecord], slo: Slo, window: float | None = None) -> dict[str, Any]:
    """count, errors, rates (req/s, tokens/s), goodput (req/s meeting the SLO), attainment, and
    ttft / itl / e2e summaries; `window` defaults to `window_s(records)`."""
    span = window_s(records) if window is None else window
    ok = [r for r in records if r.ok]
    good = [r for r in ok if slo.met(r)]
    itl = LatencyHistogram().record_all(g for r in ok for g in r.token_gaps_s)
    return {
        "count": len(records),
        "errors": len(records) - len(ok),
        "window_s": span,
        "throughput_rps": len(ok) / span if span > 0 else math.nan,
        "goodput_rps": len(good) / span if span > 0 else math.nan,
        "slo_attainment": len(good) / len(records) if records else math.nan,
        "tokens_per_s": sum(r.tokens for r in ok) / span if span > 0 else math.nan,
        "ttft": LatencyHistogram().record_all(r.ttft_s for r in ok).summary(),
        "itl": itl.summary(),
        "e2e": LatencyHistogram().record_all(r.e2e_s for r in ok).summary(),
    }


def by_kind(records: Iterable[RequestRecord], slo: Slo, window: float) -> dict[str, dict[str, Any]]:
    """`summarize` per request kind, over the whole run's window (so rates add up)."""
    groups: dict[str, list[RequestRecord]] = {}
    for r in records:
        groups.setdefault(r.kind, []).append(r)
    return {kind: summarize(rs, slo, window) for kind, rs in sorted(groups.items())}


def report(records: Sequence[RequestRecord], slo: Slo) -> dict[str, Any]:
    """The JSON-able result of a run: overall, per kind, the SLO and the raw records."""
    window = window_s(records)
    return {
        "slo": asdict(slo),
        "overall": summarize(records, slo, window),
        "by_kind": by_kind(records, slo, window),
        "records": [asdict(r) for r in records],
    }
