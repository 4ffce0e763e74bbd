"""`epd bench`: drive a running router (or colocated service) with a request mix and write results.

epd bench --mix text=0.5,image=0.5,images=4 --closed 4 --duration 60
epd bench --mix audio=1 --rate 2 --requests 200 --slo-ttft 1.5 --slo-itl 0.1 --out var/bench/audio.json

A run ends at the first bound it was given: --requests (that many measured requests), --duration
(no request starts after it), or --duration 60 when neither is given; the summary says which ended
it. It says what it does while it works (building the media, then progress every few seconds),
prints goodput only against an SLO it was given, prints the first error and exits 1 when requests
failed, and writes each run to a file of its own unless --out names one.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc

from libs.bench.load import ENDED_BY_DURATION, LoadConfig, LoadRun, MadeAhead, Prepared, RequestSource, grpc_sender
from libs.bench.load import run as run_load
from libs.bench.mix import KINDS, MixSpec, iter_requests, plan_requests
from libs.bench.results import write_json
from libs.bench.stats import Slo, report
from libs.cli.router_client import ADDRESS_FILE, DEFAULT_RUN_DIR, served, unreachable

RESULTS = Path("var/bench")
DEFAULT_DURATION_S = 60.0
MIX_HELP = (
    "the requests, as comma-separated key=value: shares of the request kinds "
    f"({', '.join(KINDS)}; weights, normalised), and their sizes: images (images per image request), "
    "max_tokens (per request), image_w and image_h (pixels), video_frames, audio_s (seconds), repeat "
    "(0..1: share of media items reused from earlier requests, to exercise the encoder cache)"
)


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    bench = sub.add_parser("bench", help="load-test a running stack: request mix, open/closed loop, SLO goodput")
    bench.add_argument("--address", default="", help=f"router address (default: RUN_DIR/{ADDRESS_FILE})")
    bench.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR, help="where `epd up` runs")
    bench.add_argument("--mix", default="text=0.5,image=0.5", help=MIX_HELP)
    loop = bench.add_mutually_exclusive_group()
    loop.add_argument("--rate", type=float, default=None, help="open loop: Poisson arrivals per second")
    loop.add_argument(
        "--closed", type=int, default=None, metavar="N", help="closed loop: N concurrent clients (the default: 1)"
    )
    bench.add_argument(
        "--duration",
        type=float,
        default=None,
        help=f"seconds: no request starts after this (default: {DEFAULT_DURATION_S:g} when --requests is not "
        "given; with both, the first bound reached ends the run)",
    )
    bench.add_argument(
        "--requests",
        type=int,
        default=None,
        help="measured requests: the run ends once this many were sent and answered (default: no count, the "
        "duration bounds the run); all are prepared before the run starts",
    )
    bench.add_argument("--warmup", type=int, default=2, help="unrecorded requests sent first, one at a time")
    bench.add_argument("--slo-ttft", type=float, default=None, help="TTFT limit for goodput (s); unset: no goodput")
    bench.add_argument(
        "--slo-itl", type=float, default=None, help="mean inter-token limit for goodput (s); unset: no goodput"
    )
    bench.add_argument("--seed", type=int, default=0, help="seed of the request mix and the arrivals")
    bench.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"result JSON (default: a new file per run, {RESULTS}/bench-YYYYMMDD-HHMMSS.json)",
    )
    bench.set_defaults(func=cmd_bench)


def _out_path(given: Path | None) -> Path:
    if given is not None:
        return given
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    path, n = RESULTS / f"bench-{stamp}.json", 2
    while path.exists():
        path, n = RESULTS / f"bench-{stamp}-{n}.json", n + 1
    return path


def describe(spec: MixSpec) -> str:
    """`50% text, 50% image (4 images each); 16 output tokens each`: the mix as a sentence."""
    kinds = [
        f"{share:.0%} {kind}" + (f" ({spec.images} images each)" if kind == "image" and spec.images > 1 else "")
        for kind, share in spec.shares().items()
        if share > 0
    ]
    return f"{', '.join(kinds)}; up to {spec.max_tokens} output tokens each"


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _prepare(spec: MixSpec, count: int, seed: int) -> list[Any]:
    """Every request of the run, built before it starts, with progress."""
    started, last = time.monotonic(), [time.monotonic()]

    def progress(done: int) -> None:
        if time.monotonic() - last[0] >= 2.0 or done == count:
            last[0] = time.monotonic()
            _say(f"  built {done}/{count} requests ({time.monotonic() - started:.1f} s)")

    _say(f"epd bench: building {count} requests ({describe(spec)}) ...")
    return plan_requests(spec, count, seed=seed, on_progress=progress)


def _source(ns: argparse.Namespace, spec: MixSpec, config: LoadConfig) -> RequestSource:
    """Prepared before the run when its count is known (a --requests run; an open loop's arrivals
    within its duration); built alongside it otherwise (a closed loop bounded by time only)."""
    if ns.requests is not None:
        return Prepared(_prepare(spec, ns.warmup + ns.requests, ns.seed))
    if config.mode == "open":
        from libs.bench.arrivals import poisson_arrivals

        arrivals = poisson_arrivals(config.rate_per_s, count=10**9, duration_s=config.duration_s, seed=config.seed)
        return Prepared(_prepare(spec, ns.warmup + len(arrivals), ns.seed))
    _say(
        f"epd bench: building requests while the run goes ({describe(spec)}), {2 * config.concurrency} ahead "
        "(give --requests N to build them all first)"
    )
    return MadeAhead(iter_requests(spec, seed=ns.seed), ahead=2 * config.concurrency)


def _progress(elapsed_s: float, done: int, failed: int, in_flight: int) -> None:
    _say(f"  {elapsed_s:5.1f} s: {done} done ({failed} failed), {in_flight} in flight")


def cmd_bench(ns: argparse.Namespace) -> int:
    from libs.client.generate import open_channel

    address_file = ns.run_dir / ADDRESS_FILE
    address = ns.address or (address_file.read_text().strip() if address_file.exists() else "")
    if not address:
        _say(f"epd bench: no --address and no running `epd up` stack in {ns.run_dir}")
        return 2
    try:
        spec = MixSpec.parse(ns.mix)
    except (ValueError, TypeError) as exc:
        _say(f"epd bench: --mix: {exc}")
        return 2
    for flag, value in (("--requests", ns.requests), ("--duration", ns.duration), ("--closed", ns.closed)):
        if value is not None and value <= 0:
            _say(f"epd bench: {flag} must be positive, got {value:g}")
            return 2
    duration = ns.duration if ns.duration is not None else (DEFAULT_DURATION_S if ns.requests is None else math.inf)
    config = LoadConfig(
        mode="open" if ns.rate is not None else "closed",
        rate_per_s=ns.rate or 1.0,
        concurrency=ns.closed or 1,
        duration_s=duration,
        max_requests=ns.requests,
        warmup_requests=ns.warmup,
        seed=ns.seed,
    )
    slo = Slo(math.inf if ns.slo_ttft is None else ns.slo_ttft, math.inf if ns.slo_itl is None else ns.slo_itl)
    with_slo = ns.slo_ttft is not None or ns.slo_itl is not None

    async def check() -> str | None:
        async with open_channel(address) as channel:
            try:
                await served(channel)
            except grpc.aio.AioRpcError as exc:
                return unreachable("epd bench", address, exc)
        return None

    if (why := asyncio.run(check())) is not None:  # before minutes of media building
        _say(why)
        return 1
    source = _source(ns, spec, config)
    bounds = [f"{ns.requests} requests"] if ns.requests is not None else []
    bounds += [f"{duration:g} s"] if duration != math.inf else []
    clients = f"{config.concurrency} client" + ("s" if config.concurrency > 1 else "")
    loop = f"open loop at {ns.rate:g}/s" if ns.rate is not None else f"closed loop, {clients}"
    _say(f"epd bench: running against {address}: {loop}, until {' or '.join(bounds)} ...")

    async def go() -> LoadRun:
        async with open_channel(address) as channel:
            try:
                return await run_load(grpc_sender(channel), source, config, on_progress=_progress)
            finally:
                if isinstance(source, MadeAhead):
                    source.close()

    done = asyncio.run(go())
    records = done.records
    result: dict[str, Any] = {
        "mix": spec.describe(),
        "config": dataclasses.asdict(config),
        "ended_by": done.ended_by,
        **report(records, slo),
    }
    if not with_slo:  # goodput against no SLO is the throughput again: say nothing rather than repeat it
        result["slo"] = None
        for summary in (result["overall"], *result["by_kind"].values()):
            summary.pop("goodput_rps"), summary.pop("slo_attainment")
    if isinstance(source, MadeAhead):
        result["client_waits_for_media"] = {"count": source.waits, "seconds": source.waited_s}
    out = _out_path(ns.out)
    write_json(out, result)
    print(_summary(result, ns, duration, with_slo) + f" -> {out}")
    if isinstance(source, MadeAhead) and source.waits > config.concurrency:
        _say(
            f"epd bench: clients waited {source.waits} times ({source.waited_s:.1f} s) for their next request's "
            "media: the stack outran the client; give --requests N to build them all first"
        )
    failed = [r for r in records if r.error]
    if failed:
        _say(f"epd bench: {len(failed)} of {len(records)} requests failed; the first: {failed[0].error}")
        return 1
    if not records:
        _say("epd bench: no request was measured")
        return 1
    return 0


def _summary(result: dict[str, Any], ns: argparse.Namespace, duration: float, with_slo: bool) -> str:
    overall = result["overall"]
    if result["ended_by"] == ENDED_BY_DURATION:
        ended = f"--duration {duration:g} s reached"
    else:
        ended = f"all {ns.requests} --requests answered" if ns.requests is not None else "the requests ran out"
    line = (
        f"{overall['count']} requests ({overall['errors']} failed) in {overall['window_s']:.1f} s, ended: {ended}; "
        f"{overall['throughput_rps']:.2f} req/s"
    )
    if with_slo:
        line += f", goodput {overall['goodput_rps']:.2f} req/s ({overall['slo_attainment']:.0%} within the SLO)"
    ttft, itl = overall["ttft"], overall["itl"]
    if ttft["count"]:
        line += f"; TTFT p50 {ttft['p50_s'] * 1e3:.0f} ms p90 {ttft['p90_s'] * 1e3:.0f} ms"
    if itl["count"]:
        line += f"; ITL p50 {itl['p50_s'] * 1e3:.1f} ms"
    return line
