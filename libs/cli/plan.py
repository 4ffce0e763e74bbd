"""`epd plan`: capacity planning from a measured run's spans (libs/plan).

epd plan --trace var/bench/run/p7-e+pd/spans.jsonl --mix text=0.5,image=0.5 --rate 0.4 --slo-ttft 5
epd plan --trace spans.jsonl --mix text=0.5,image=0.5 --clients 4 --instances 1,1   # predict only
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from libs.bench.mix import MixSpec


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    plan = sub.add_parser("plan", help="recommend encoder/prefill/decode instances for a load (simulation)")
    plan.add_argument("--trace", type=Path, required=True, help="JSONL spans of a measured run (epd up / benches)")
    plan.add_argument("--mix", default="text=0.5,image=0.5", help="target request mix (kinds' shares)")
    load = plan.add_mutually_exclusive_group(required=True)
    load.add_argument("--rate", type=float, help="open loop: arrivals per second")
    load.add_argument("--clients", type=int, help="closed loop: concurrent clients")
    plan.add_argument("--slo-ttft", type=float, default=5.0, help="p90 TTFT limit (s)")
    plan.add_argument("--layout", choices=("e+pd", "e/p/d"), default=None, help="default: the measured run's")
    plan.add_argument("--instances", default="", help="predict for E,P[,D] instances instead of recommending")
    plan.add_argument("--max-instances", type=int, default=12)
    plan.add_argument("--duration", type=float, default=600.0, help="simulated seconds")
    plan.add_argument("--max-tokens", type=int, default=8)
    plan.add_argument("--seed", type=int, default=0)
    plan.set_defaults(func=cmd_plan)


def cmd_plan(ns: argparse.Namespace) -> int:
    from libs.plan.profile import profile
    from libs.plan.simulate import Layout, Workload, recommend, simulate
    from libs.telemetry.spans import load_jsonl

    if not ns.trace.exists():
        print(f"epd plan: no span file at {ns.trace}", file=sys.stderr)
        return 2
    measured = profile(load_jsonl(ns.trace))
    if not measured.requests:
        print("epd plan: no request traces with prefill spans in the file", file=sys.stderr)
        return 2
    spec = MixSpec.parse(ns.mix)
    mix = spec.shares()
    kind = ns.layout or measured.layout
    workload = Workload(
        mix, rate_per_s=ns.rate or 0.0, clients=ns.clients or 0, duration_s=ns.duration, max_tokens=ns.max_tokens
    )
    print(f"measured ({measured.layout}, {len(measured.requests)} requests): {measured.summary()}")
    if ns.instances:
        counts = [int(c) for c in ns.instances.split(",")]
        layout = Layout(kind, *counts)
        result = simulate(measured, layout, workload, seed=ns.seed)
        _print(layout, result)
        return 0
    best = recommend(measured, kind, workload, ns.slo_ttft, max_instances=ns.max_instances, seed=ns.seed)
    if best is None:
        print(f"no {kind} layout of at most {ns.max_instances} instances meets p90 TTFT <= {ns.slo_ttft} s")
        return 1
    print(f"recommended: {best[0].describe()} ({best[0].total()} instances)")
    _print(*best)
    return 0


def _print(layout: object, result: object) -> None:
    from libs.plan.simulate import SimResult

    assert isinstance(result, SimResult)
    kinds = ", ".join(f"{k} {h.percentile(90) * 1e3:.0f} ms" for k, h in sorted(result.ttft.items()))
    print(f"{layout}: predicted p90 TTFT {kinds}; throughput {result.throughput():.3f} req/s")
