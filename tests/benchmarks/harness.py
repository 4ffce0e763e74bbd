"""Shared plumbing of the EPD experiments (tests/benchmarks/experiments.py): stacks on the small
checkpoint with CPU pinned per process, traced to a JSONL file each; clients; span helpers.

Equal CPU: every layout gets the same cores. `shared` puts every process on all cores with as many
torch threads as cores (one request at a time: whichever stage runs has the whole machine);
`split` gives the encoder(s) and the language-model stage(s) disjoint halves, one torch thread per
core they own, against a colocated process with all cores and all threads. The router (light,
no torch compute) may run on any core in every layout; the load generator runs unpinned.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from libs.launch.stack import Stack, StackSpec  # noqa: E402
from libs.telemetry.spans import SpanRecord, load_jsonl  # noqa: E402

CORES = tuple(sorted(os.sched_getaffinity(0)))[:2]
ALL = CORES
HALF_E, HALF_LM = CORES[:1], CORES[1:2] or CORES[:1]


def cpu_plan(layout: str, cpus: str) -> dict[str, tuple[tuple[int, ...], int]]:
    """Service name -> (cores, torch threads) for `layout` under the `shared` or `split` plan."""
    if layout == "colocated" or cpus == "shared":
        every = {"colocated": (ALL, len(ALL)), "router": (ALL, 1)}
        for name in ("encoder-0", "encoder-1", "pd", "prefill", "decode"):
            every[name] = (ALL, len(ALL))
        return every
    return {
        "router": (ALL, 1),
        "encoder-0": (HALF_E, len(HALF_E)),
        "pd": (HALF_LM, len(HALF_LM)),
        "prefill": (HALF_LM, len(HALF_LM)),
        "decode": (HALF_LM, len(HALF_LM)),
    }


def pin_tree(pid: int, cores: tuple[int, ...]) -> int:
    """Pin every thread of process `pid` (threads started later inherit it); returns threads pinned."""
    pinned = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
            os.sched_setaffinity(int(tid), cores)
            pinned += 1
    return pinned


@dataclass
class BenchStack:
    name: str
    layout: str
    stack: Stack
    trace_file: Path
    cpus: str
    address: str = ""
    pinned: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def spans(self) -> list[SpanRecord]:
        return load_jsonl(self.trace_file) if self.trace_file.exists() else []

    def process_address(self, name: str) -> str:
        return self.stack.processes[name].address


def make_stack(
    name: str,
    layout: str,
    model: Path,
    run_dir: Path,
    *,
    cpus: str = "shared",
    threads: int | None = None,
    extra_args: dict[str, list[str]] | None = None,
    run_through: dict[str, list[str]] | None = None,
    env: dict[str, str] | None = None,
    engine: str = "reference",
) -> BenchStack:
    """A stack (not started) with its CPU plan's torch threads and its own span file."""
    plan = cpu_plan(layout, cpus)
    trace_file = run_dir / name / "spans.jsonl"
    args: dict[str, list[str]] = {}
    for service, (_, count) in plan.items():
        if service != "router":
            args[service] = ["--torch-threads", str(threads if threads is not None else count)]
    for service, more in (extra_args or {}).items():
        args[service] = [*args.get(service, []), *more]
    spec = StackSpec(
        layout=layout,
        encoders=1,
        model=model,
        run_dir=run_dir / name,
        pool_mib=256,
        env={
            "EPD_TRACE_EXPORTER": "jsonl",
            "EPD_TRACE_FILE": str(trace_file),
            "EPD_LOG_LEVEL": "warning",
            "EPD_WARM_UP": "true",  # first contact before traffic (services/router/warmup.py)
            **(env or {}),
        },
        extra_args=args,
        run_through=run_through or {},
        engine=engine,
        ready_timeout_s=300.0 if engine == "reference" else 600.0,
    )
    return BenchStack(name, layout, Stack(spec), trace_file, cpus)


def start(bench: BenchStack) -> BenchStack:
    bench.address = bench.stack.up()
    plan = cpu_plan(bench.layout, bench.cpus)
    for service, process in bench.stack.processes.items():
        cores = plan.get(service, (ALL, 1))[0]
        # vLLM runs its engine core and worker as child processes: they get the service's cores.
        for pid in [process.pid, *(c.pid for c in psutil.Process(process.pid).children(recursive=True))]:
            pin_tree(pid, cores)
        bench.pinned[service] = cores
    return bench


@contextlib.contextmanager
def running(*stacks: BenchStack) -> Iterator[tuple[BenchStack, ...]]:
    """Start the stacks one after the other (each loads the model), stop them all by PID at exit."""
    started: list[BenchStack] = []
    try:
        for s in stacks:
            t0 = time.monotonic()
            started.append(start(s))
            print(f"  {s.name}: {s.layout} up in {time.monotonic() - t0:.0f} s at {s.address}", flush=True)
        yield tuple(started)
    finally:
        for s in reversed(stacks):
            s.stack.down()


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.1f} / {five:.1f} / {fifteen:.1f} (1/5/15 min) on {os.cpu_count()} cores"


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def run_async(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]
