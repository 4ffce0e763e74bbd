"""Latency attribution of requests from their spans (what `epd trace report` prints).

For each request (a trace whose root is a `GenerateService/Generate` server span), time to first
token (the root's `epd.ttft_s`) is split into the stages of `libs.telemetry.stages.STAGES`, then
time no stage span covers into `rpc` (hops: a caller's call span outside the callee's server
span), `service` (a backend's bookkeeping) and `router` (the router's own), by the innermost span
marked `epd.attribution`, and `other` (covered by no marked span either). The split is a
partition: every instant between the request's start and its first token is attributed to exactly
one category, so the parts add up to TTFT. Where stage spans overlap (media encoded in parallel),
an instant goes to the active stage span on the branch that ends last (a branch: the span's parent,
e.g. one item's Encode server span; then the span itself): the request waits for that branch, so
its queue, preprocess and encode are the critical path, not whichever item's stage ends later.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from libs.telemetry.spans import SpanRecord, by_trace
from libs.telemetry.stages import ATTRIBUTION, HOPS, STAGES

CATEGORIES = (*STAGES, *HOPS, "other")
ROOT_NAME = "GenerateService/Generate"


@dataclass
class RequestBreakdown:
    trace_id: str
    start_ns: int
    request_id: str
    services: list[str]
    ttft_s: float
    e2e_s: float
    output_tokens: int
    parts: dict[str, float]  # category -> seconds of TTFT
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from a cached prefix
    held_items: int = 0  # media items no encoder saw: the member held them (contract 1.9)

    @property
    def after_first_token_s(self) -> float:
        return self.e2e_s - self.ttft_s


def _root(spans: list[SpanRecord]) -> SpanRecord | None:
    # The outermost Generate server span: its parent may be a traced client's span (not in the file)
    # or the OpenAI door's HTTP span (in the file, another name); a Generate inside a Generate is not.
    generate = {s.span_id for s in spans if s.name == ROOT_NAME}
    roots = [s for s in spans if s.name == ROOT_NAME and s.parent_id not in generate]
    return min(roots, key=lambda s: s.start_ns) if roots else None


def attribute(spans: list[SpanRecord], start_ns: int, end_ns: int) -> dict[str, float]:
    """Partition [start_ns, end_ns) among stage categories (see the module docstring)."""
    inside = [s for s in spans if s.end_ns > start_ns and s.start_ns < end_ns]
    staged = [s for s in inside if s.attributes.get("epd.stage") in STAGES]
    marked = [s for s in inside if s.attributes.get(ATTRIBUTION) in HOPS and "epd.stage" not in s.attributes]
    edges = (max(start_ns, min(end_ns, t)) for s in (*staged, *marked) for t in (s.start_ns, s.end_ns))
    cuts = sorted({start_ns, end_ns, *edges})
    ends = {s.span_id: s.end_ns for s in spans}

    def critical(s: SpanRecord) -> tuple[int, int, int]:
        return (ends.get(s.parent_id or "", s.end_ns), s.end_ns, s.start_ns)

    parts = dict.fromkeys(CATEGORIES, 0.0)
    for lo, hi in itertools.pairwise(cuts):
        active = [s for s in staged if s.start_ns <= lo and s.end_ns >= hi]
        if active:
            category = str(max(active, key=critical).attributes["epd.stage"])
        else:
            # No stage: the innermost marked span (the one that started last) says whose time it is.
            hops = [s for s in marked if s.start_ns <= lo and s.end_ns >= hi]
            category = (
                str(max(hops, key=lambda s: (s.start_ns, -s.end_ns)).attributes[ATTRIBUTION]) if hops else "other"
            )
        parts[category] += (hi - lo) / 1e9
    return parts


def breakdowns(spans: Iterable[SpanRecord]) -> list[RequestBreakdown]:
    """One breakdown per request trace, in start order; traces without a finished root are skipped."""
    out = []
    for trace_id, trace_spans in by_trace(spans).items():
        root = _root(trace_spans)
        if root is None or "epd.ttft_s" not in root.attributes:
            continue
        ttft_s = float(root.attributes["epd.ttft_s"])
        parts = attribute(trace_spans, root.start_ns, root.start_ns + int(ttft_s * 1e9))
        out.append(
            RequestBreakdown(
                trace_id=trace_id,
                start_ns=root.start_ns,
                request_id=str(root.attributes.get("epd.request_id", "")),
                services=sorted({s.service for s in trace_spans}),
                ttft_s=ttft_s,
                e2e_s=root.duration_s,
                output_tokens=int(root.attributes.get("gen_ai.usage.output_tokens", 0)),
                parts=parts,
                prompt_tokens=int(root.attributes.get("gen_ai.usage.input_tokens", 0)),
                cached_tokens=int(root.attributes.get("epd.usage.cached_input_tokens", 0)),
                held_items=int(root.attributes.get("epd.encode.held_items", 0)),
            )
        )
    return sorted(out, key=lambda b: b.start_ns)


# Prefixes of the ids the OpenAI door answers with (`chatcmpl-<request id>`): the request id follows.
_DOOR_PREFIXES = ("chatcmpl-", "cmpl-")


def matching(items: list[RequestBreakdown], ident: str) -> list[RequestBreakdown]:
    """The requests an id names, as a user has it: the request id `epd generate` prints, the OpenAI
    door's response id (`chatcmpl-<request id>`; its choices when it asked for several, `<id>-i`),
    a report row's label, a trace id; or the start of one of them (8 characters at least)."""
    wanted = ident.strip().strip("[]")
    for prefix in _DOOR_PREFIXES:
        wanted = wanted.removeprefix(prefix)
    exact = [b for b in items if wanted in (b.request_id, b.trace_id)]
    if exact or len(wanted) < 8:
        return exact
    return [b for b in items if b.request_id.startswith(wanted) or b.trace_id.startswith(wanted)]


def _percentile(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def render_text(items: list[RequestBreakdown]) -> str:
    """Per-request rows and p50/p90/p99 rows, milliseconds."""
    if not items:
        return "no request traces found (is the trace exporter on? has a request through the router finished?)\n"
    columns = ["ttft", *CATEGORIES, "e2e"]
    # Whole ids (what `epd generate` and the OpenAI door print, what --waterfall takes), not cut.
    width = max(20, *(len(b.request_id or b.trace_id) for b in items))
    header = (
        f"{'request':<{width}} " + " ".join(f"{c:>10}" for c in columns) + f" {'tokens':>6} {'cached':>13} {'held':>4}"
    )
    lines = [
        "time to first token split by stage (ms); rpc = hops (call minus server span), service / router = "
        "their bookkeeping, other = no span; cached = prompt tokens from a cached prefix / prompt tokens, "
        "held = media items no encoder saw (the member held them)",
        header,
    ]

    def row(label: str, values: list[float], tokens: str, cached: str = "", held: str = "") -> str:
        times = " ".join(f"{v * 1e3:>10.2f}" for v in values)
        return f"{label:<{width}} {times} {tokens:>6} {cached:>13} {held:>4}".rstrip()

    for b in items:
        values = [b.ttft_s, *(b.parts[c] for c in CATEGORIES), b.e2e_s]
        cached = f"{b.cached_tokens}/{b.prompt_tokens}"
        lines.append(row(b.request_id or b.trace_id, values, str(b.output_tokens), cached, str(b.held_items)))
    for q in (50, 90, 99):
        series = [
            [b.ttft_s for b in items],
            *([b.parts[c] for b in items] for c in CATEGORIES),
            [b.e2e_s for b in items],
        ]
        lines.append(row(f"p{q} ({len(items)} requests)", [_percentile(s, q) for s in series], ""))
    cached_share = sum(b.cached_tokens for b in items) / max(1, sum(b.prompt_tokens for b in items))
    lines.append(
        f"prompt tokens from a cached prefix: {cached_share:.0%}; media items held, not encoded: "
        f"{sum(b.held_items for b in items)}"
    )
    return "\n".join(lines) + "\n"
