"""Per-request service times from a measured run's spans (what the simulation samples from).

For every request trace (a `GenerateService/Generate` root with `epd.ttft_s`): its kind (text, or
the modality of its media items and how many), each item's encode time on the encoder's engine
thread (`encoder.preprocess` + `encoder.compute`), prefill's engine time (`epd.engine.busy_s` on
`prefill.compute`: chunks run, waits excluded; else the span), prompt and output tokens, the decode
inter-token time, and the fixed part of TTFT: hops, bookkeeping and transfers (`rpc`, `service`,
`router`, `transfer`, `other` of the attribution), which no queue in the model lengthens.
Decode: each request's steps, their mean engine time and mean batch size (`epd.decode.*` on
`decode.generate`); a step's cost is fitted as a line in its batch size over all requests.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

from libs.telemetry.report import breakdowns
from libs.telemetry.spans import SpanRecord, by_trace

FIXED = ("rpc", "service", "router", "transfer", "other", "cache_load")


@dataclass(frozen=True)
class RequestProfile:
    kind: str  # "text", "image", "audio", "video"
    items: int
    encode_s: tuple[float, ...]  # per Encode call (an item, or a request's items together), engine time
    prefill_s: float  # engine time
    prompt_tokens: int
    output_tokens: int
    inter_token_s: float
    fixed_s: float  # part of TTFT no modelled queue affects
    ttft_s: float
    decode_steps: int = 0  # decode steps the sequence took part in
    step_engine_s: float = 0.0  # their mean engine time
    batch_mean: float = 0.0  # their mean batch size


@dataclass
class Profile:
    layout: str
    requests: list[RequestProfile] = field(default_factory=list)
    chunk_tokens: int = 256  # prompt tokens per prefill chunk of the measured services

    def of_kind(self, kind: str) -> list[RequestProfile]:
        return [r for r in self.requests if r.kind == kind]

    def kinds(self) -> list[str]:
        return sorted({r.kind for r in self.requests})

    def decode_step_s(self) -> float:
        """One decode step with a batch of one: the low decile of measured inter-token times (the
        ones least stretched by prefill chunks sharing the engine thread)."""
        gaps = sorted(r.inter_token_s for r in self.requests if r.inter_token_s > 0)
        return gaps[len(gaps) // 10] if gaps else 0.02

    def step_cost(self) -> tuple[float, float] | None:
        """(base, per sequence): a decode step with a batch of b costs base + per_sequence * b
        seconds, fitted by least squares (weighted by steps) to the requests' mean step engine
        times and batch sizes; None without steps at two or more batch sizes."""
        points = [(r.batch_mean, r.step_engine_s, r.decode_steps) for r in self.requests if r.decode_steps > 0]
        weight = sum(w for _, _, w in points)
        if not points or max(b for b, _, _ in points) - min(b for b, _, _ in points) < 0.5:
            return None
        mean_b = sum(b * w for b, _, w in points) / weight
        mean_s = sum(s * w for _, s, w in points) / weight
        spread = sum(w * (b - mean_b) ** 2 for b, _, w in points)
        slope = max(0.0, sum(w * (b - mean_b) * (s - mean_s) for b, s, w in points) / spread)
        return max(0.0, mean_s - slope * mean_b), slope

    def summary(self) -> dict[str, dict[str, float]]:
        out = {}
        for kind in self.kinds():
            rs = self.of_kind(kind)
            out[kind] = {
                "requests": len(rs),
                "items": statistics.fmean(r.items for r in rs),
                "encode_s_per_call": statistics.fmean(e for r in rs for e in r.encode_s) if rs[0].items else 0.0,
                "prefill_s": statistics.fmean(r.prefill_s for r in rs),
                "prompt_tokens": statistics.fmean(r.prompt_tokens for r in rs),
                "fixed_s": statistics.fmean(r.fixed_s for r in rs),
            }
        return out


def _layout(services: set[str]) -> str:
    if "colocated" in services:
        return "colocated"
    return "e/p/d" if "decode" in services else "e+pd"


def profile(spans: Iterable[SpanRecord]) -> Profile:
    spans = list(spans)
    traces = by_trace(spans)
    out: list[RequestProfile] = []
    layouts: list[str] = []
    chunk_sizes: list[int] = []
    for item in breakdowns(spans):
        trace = traces[item.trace_id]
        children: dict[str, list[SpanRecord]] = {}
        for s in trace:
            children.setdefault(s.parent_id, []).append(s)
        calls = [s for s in trace if s.name == "epd.encode.item"]  # one per Encode call: one item or several
        modalities = [str(s.attributes.get("epd.modality", "")) for s in calls]
        encodes = []
        for server in (s for s in trace if s.name == "EncoderService/Encode"):
            encodes.append(
                sum(
                    c.duration_s
                    for c in children.get(server.span_id, [])
                    if c.name in ("encoder.preprocess", "encoder.compute")
                )
            )
        prefills = [s for s in trace if s.name == "prefill.compute"]
        if not prefills:
            continue
        prefill = prefills[0]
        decode = next((s for s in trace if s.name == "decode.generate"), None)
        kind = modalities[0].removeprefix("MODALITY_").lower() if modalities else "text"
        layouts.append(_layout(set(item.services)))
        if "epd.prefill.chunk_tokens" in prefill.attributes:
            chunk_sizes.append(int(prefill.attributes["epd.prefill.chunk_tokens"]))
        steps = decode.attributes if decode else {}
        out.append(
            RequestProfile(
                kind=kind,
                items=sum(int(s.attributes.get("epd.items", 1)) for s in calls),
                encode_s=tuple(encodes),
                prefill_s=float(prefill.attributes.get("epd.engine.busy_s", prefill.duration_s)),
                prompt_tokens=int(prefill.attributes.get("epd.prompt_tokens", 0)),
                output_tokens=item.output_tokens,
                inter_token_s=float(decode.attributes.get("epd.decode.inter_token_s", 0.0)) if decode else 0.0,
                fixed_s=sum(item.parts[c] for c in FIXED),
                ttft_s=item.ttft_s,
                decode_steps=int(steps.get("epd.decode.steps", 0)),
                step_engine_s=float(steps.get("epd.decode.step_engine_s", 0.0)),
                batch_mean=float(steps.get("epd.decode.batch_mean", 0.0)),
            )
        )
    layout = max(set(layouts), key=layouts.count) if layouts else "e+pd"
    chunk = max(set(chunk_sizes), key=chunk_sizes.count) if chunk_sizes else 256  # before it was recorded
    return Profile(layout, out, chunk)
