"""`epd plan`: capacity planning from a measured run's spans (libs/plan).

epd plan --trace var/bench/run/p7-e+pd/spans.jsonl --mix text=0.5,image=0.5 --rate 0.4 --slo-ttft 5
epd plan --trace spans.jsonl --mix text=0.5,image=0.5 --clients 4 --instances 1,1   # predict only
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from libs.bench.mix import MixSpec
from libs.cli.table import table

if TYPE_CHECKING:
    from libs.plan.profile import Profile
    from libs.plan.simulate import Layout, SimResult

PLANNED = ("e+pd", "e/p/d")
ROLES = {"e+pd": ("E", "PD"), "e/p/d": ("E", "P", "D")}


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    plan = sub.add_parser("plan", help="recommend encoder/prefill/decode instances for a load (simulation)")
    plan.add_argument("--trace", type=Path, required=True, help="JSONL spans of a measured run (epd up / benches)")
    plan.add_argument("--mix", default="text=0.5,image=0.5", help="target request mix: kinds' shares (as epd bench)")
    load = plan.add_mutually_exclusive_group(required=True)
    load.add_argument("--rate", type=float, help="open loop: arrivals per second")
    load.add_argument("--clients", type=int, help="closed loop: concurrent clients")
    plan.add_argument("--slo-ttft", type=float, default=5.0, help="p90 TTFT limit (s)")
    plan.add_argument("--layout", choices=PLANNED, default=None, help="layout to plan (unset: the measured run's)")
    plan.add_argument(
        "--instances",
        default="",
        help="predict for these instance counts instead of recommending: E,PD for e+pd, E,P,D for e/p/d",
    )
    plan.add_argument("--max-instances", type=int, default=12, help="largest stack a recommendation considers")
    plan.add_argument("--duration", type=float, default=600.0, help="simulated seconds")
    plan.add_argument("--max-tokens", type=int, default=8, help="output tokens per request")
    plan.add_argument("--seed", type=int, default=0, help="seed of the simulated arrivals")
    plan.set_defaults(func=cmd_plan)


def parse_instances(text: str, kind: str) -> Layout:
    """`--instances 2,1` -> Layout("e+pd", 2, 1); ValueError naming the flag and what it takes."""
    from libs.plan.simulate import Layout

    roles = ROLES[kind]
    takes = f"{len(roles)} counts, {','.join(roles)}"
    try:
        counts = [int(c) for c in text.split(",")]
    except ValueError:
        raise ValueError(f"--instances {text}: not whole numbers; the {kind} layout takes {takes}") from None
    if len(counts) != len(roles):
        raise ValueError(
            f"--instances {text}: the {kind} layout takes {takes} (e.g. --instances {','.join('1' * len(roles))}); "
            f"got {len(counts)}" + (" (--layout picks another layout)" if len(counts) in (2, 3) else "")
        )
    if min(counts) < 1:
        raise ValueError(f"--instances {text}: every role needs at least one instance")
    return Layout(kind, *counts)


def cmd_plan(ns: argparse.Namespace) -> int:
    from libs.plan.profile import profile
    from libs.plan.simulate import Workload, recommend, simulate
    from libs.telemetry.spans import load_jsonl

    try:
        spec = MixSpec.parse(ns.mix)
    except (ValueError, TypeError) as exc:
        print(f"epd plan: --mix: {exc}", file=sys.stderr)
        return 2
    if ns.layout is not None and ns.instances:
        try:
            parse_instances(ns.instances, ns.layout)  # refused before the spans are read
        except ValueError as exc:
            print(f"epd plan: {exc}", file=sys.stderr)
            return 2
    if not ns.trace.exists():
        print(f"epd plan: no span file at {ns.trace}", file=sys.stderr)
        return 2
    measured = profile(load_jsonl(ns.trace))
    if not measured.requests:
        print("epd plan: no request traces with prefill spans in the file", file=sys.stderr)
        return 2
    kind = ns.layout or measured.layout
    if kind not in PLANNED:
        print(f"epd plan: the measured run is {kind}; plan e+pd or e/p/d with --layout", file=sys.stderr)
        return 2
    workload = Workload(
        spec.shares(),
        rate_per_s=ns.rate or 0.0,
        clients=ns.clients or 0,
        duration_s=ns.duration,
        max_tokens=ns.max_tokens,
    )
    try:
        layout = parse_instances(ns.instances, kind) if ns.instances else None
    except ValueError as exc:
        print(f"epd plan: {exc}", file=sys.stderr)
        return 2
    print(f"measured: {measured.layout}, {len(measured.requests)} requests ({ns.trace})")
    print(measured_table(measured))
    load = f"{ns.rate:g} requests/s" if ns.rate else f"{ns.clients} clients"
    shares = ",".join(f"{k}={v:g}" for k, v in spec.shares().items() if v > 0)
    load += f" ({shares}; {ns.max_tokens} output tokens)"
    if layout is not None:
        print(f"predicted at {load}:")
        print(prediction_table([(layout, simulate(measured, layout, workload, seed=ns.seed))]), end="")
        return 0
    best = recommend(measured, kind, workload, ns.slo_ttft, max_instances=ns.max_instances, seed=ns.seed)
    if best is None:
        print(f"no {kind} layout of at most {ns.max_instances} instances meets p90 TTFT <= {ns.slo_ttft:g} s at {load}")
        return 1
    print(f"recommended for p90 TTFT <= {ns.slo_ttft:g} s at {load}:")
    print(prediction_table([best]), end="")
    return 0


def measured_table(measured: Profile) -> str:
    rows = [
        [
            kind,
            int(s["requests"]),
            f"{s['items']:.1f}",
            f"{s['encode_s_per_call'] * 1e3:.1f}",
            f"{s['prefill_s'] * 1e3:.1f}",
            f"{s['prompt_tokens']:.0f}",
            f"{s['fixed_s'] * 1e3:.1f}",
        ]
        for kind, s in measured.summary().items()
    ]
    header = ["kind", "requests", "items", "encode_ms", "prefill_ms", "prompt_tokens", "fixed_ms"]
    return table(header, rows)


def prediction_table(results: list[tuple[Layout, SimResult]]) -> str:
    kinds = sorted({k for _, result in results for k in result.ttft if k != "all"})
    header = ["layout", "instances", "p90_ttft_ms", *[f"{k}_p90_ms" for k in kinds], "requests/s"]
    rows = []
    for layout, result in results:
        p90 = [_ms(result.p90()), *[_ms(result.p90(k)) for k in kinds]]
        rows.append([counts(layout), layout.total(), *p90, f"{result.throughput():.3f}"])
    return table(header, rows)


def counts(layout: Layout) -> str:
    """`2E+1PD`, `1E+2P+1D`: one word, so the table splits on whitespace."""
    numbers = (
        (layout.encoders, layout.prefill) if layout.kind == "e+pd" else (layout.encoders, layout.prefill, layout.decode)
    )
    return "+".join(f"{n}{role}" for n, role in zip(numbers, ROLES[layout.kind], strict=True))


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1e3:.0f}"
