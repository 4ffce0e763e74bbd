"""`epd bench`: drive a running router (or colocated service) with a request mix and write results.

epd bench --mix text=0.5,image=0.5,images=4 --closed 4 --duration 60 --out var/bench/run.json
epd bench --mix audio=1 --rate 2 --requests 200 --slo-ttft 1.5 --slo-itl 0.1
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from pathlib import Path

from libs.bench.load import LoadConfig, grpc_sender, run_load
from libs.bench.mix import MixSpec, plan_requests
from libs.bench.results import write_json
from libs.bench.stats import RequestRecord, Slo, report
from libs.cli.router_client import ADDRESS_FILE


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    bench = sub.add_parser("bench", help="load-test a running stack: request mix, open/closed loop, SLO goodput")
    bench.add_argument("--address", default="", help=f"router address (default: RUN_DIR/{ADDRESS_FILE})")
    bench.add_argument("--run-dir", type=Path, default=Path("var/run/stack"))
    bench.add_argument("--mix", default="text=0.5,image=0.5", help="request mix spec (libs/bench/mix.py)")
    loop = bench.add_mutually_exclusive_group()
    loop.add_argument("--rate", type=float, default=None, help="open loop: Poisson arrivals per second")
    loop.add_argument("--closed", type=int, default=None, metavar="N", help="closed loop: N concurrent clients")
    bench.add_argument("--duration", type=float, default=60.0, help="no request starts after this (s)")
    bench.add_argument("--requests", type=int, default=200, help="at most this many measured requests")
    bench.add_argument("--warmup", type=int, default=2, help="unrecorded requests sent first, one at a time")
    bench.add_argument("--slo-ttft", type=float, default=float("inf"), help="TTFT limit for goodput (s)")
    bench.add_argument("--slo-itl", type=float, default=float("inf"), help="mean inter-token limit for goodput (s)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--out", type=Path, default=Path("var/bench/bench.json"))
    bench.set_defaults(func=cmd_bench)


def cmd_bench(ns: argparse.Namespace) -> int:
    from libs.client.generate import open_channel

    address_file = ns.run_dir / ADDRESS_FILE
    address = ns.address or (address_file.read_text().strip() if address_file.exists() else "")
    if not address:
        print("epd bench: no --address and no running `epd up` stack", file=sys.stderr)
        return 2
    try:
        spec = MixSpec.parse(ns.mix)
    except (ValueError, TypeError) as exc:
        print(f"epd bench: --mix: {exc}", file=sys.stderr)
        return 2
    config = LoadConfig(
        mode="open" if ns.rate is not None else "closed",
        rate_per_s=ns.rate or 1.0,
        concurrency=ns.closed or 1,
        duration_s=ns.duration,
        max_requests=ns.requests,
        warmup_requests=ns.warmup,
        seed=ns.seed,
    )
    plan = plan_requests(spec, ns.warmup + ns.requests, seed=ns.seed)
    slo = Slo(ns.slo_ttft, ns.slo_itl)

    async def run() -> list[RequestRecord]:
        async with open_channel(address) as channel:
            return await run_load(grpc_sender(channel), plan, config)

    records = asyncio.run(run())
    result = {"mix": spec.describe(), "config": dataclasses.asdict(config), **report(records, slo)}
    write_json(ns.out, result)
    overall = result["overall"]
    print(
        f"{overall['count']} requests ({overall['errors']} failed) in {overall['window_s']:.1f} s: "
        f"{overall['throughput_rps']:.2f} req/s, goodput {overall['goodput_rps']:.2f} req/s; "
        f"TTFT p50 {overall['ttft']['p50_s'] * 1e3:.0f} ms p90 {overall['ttft']['p90_s'] * 1e3:.0f} ms; "
        f"ITL p50 {overall['itl']['p50_s'] * 1e3:.1f} ms -> {ns.out}"
    )
    return 0
