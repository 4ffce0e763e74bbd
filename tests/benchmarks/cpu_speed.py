"""How fast each CPU of this host runs, second by second (not a test): a check before reading a
benchmark's ratios where both sides run the same code, as at c=1 (docs/results/bench-vs-vllm.md).

One process pinned to each CPU repeats the same unit of pure-Python work for `--seconds`, all at
once, and reports per CPU the unit's time: least, median, 90th percentile, and the median of each
second. On a quiet host every second reads alike; on a shared one (a VM whose cores the hypervisor
shares) a CPU moves between speeds for seconds at a time, each CPU on its own.

    .venv/bin/python tests/benchmarks/cpu_speed.py --seconds 30
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time

from harness import pct  # tests/benchmarks/harness.py: this script's folder is on sys.path

UNIT_ITERATIONS = 200_000  # a unit short enough to read second by second


def unit() -> float:
    """Seconds one fixed unit of work takes here."""
    start = time.perf_counter()
    total = 0
    for i in range(UNIT_ITERATIONS):
        total += i * i
    return time.perf_counter() - start


def trace(cpu: int, seconds: float) -> list[tuple[float, float]]:
    """(seconds since start, ms per unit) for every unit run on `cpu` for `seconds`."""
    os.sched_setaffinity(0, {cpu})
    start = time.monotonic()
    out = []
    while (now := time.monotonic() - start) < seconds:
        out.append((now, 1000 * unit()))
    return out


def summary(cpu: int, samples: list[tuple[float, float]]) -> str:
    times = sorted(ms for _, ms in samples)
    by_second: dict[int, list[float]] = {}
    for at, ms in samples:
        by_second.setdefault(int(at), []).append(ms)
    seconds = [statistics.median(v) for _, v in sorted(by_second.items())]
    return (
        f"cpu {cpu}: {len(times)} units, ms per unit least {times[0]:.1f}, median {statistics.median(times):.1f}, "
        f"p90 {pct(times, 90):.1f}; slowest second / fastest {max(seconds) / min(seconds):.2f}x\n"
        f"  per second: {' '.join(f'{ms:.0f}' for ms in seconds)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30.0)
    ns = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    with multiprocessing.Pool(len(cpus)) as pool:
        traces = pool.starmap(trace, [(cpu, ns.seconds) for cpu in cpus])
    for cpu, samples in zip(cpus, traces, strict=True):
        print(summary(cpu, samples))


if __name__ == "__main__":
    main()
