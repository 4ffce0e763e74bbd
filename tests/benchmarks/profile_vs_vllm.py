"""Profile (not a test): where the CPU of one `make bench-vs-vllm` configuration goes under load.

Deploys the configuration as the benchmark does (tests/benchmarks/peers/vs_vllm.py), warms it up, then runs one
`vllm bench serve` point while py-spy samples every process of the deployment (children too: vLLM's
EngineCore) (50 Hz unless
`--rate`). Writes, under OUT: one collapsed-stack file per process (`<pid>.txt`, py-spy's
raw format: flame graphs, or `--top`), `pids.json`, and `summary.json` (the point's metrics and the
CPU seconds each process used during it). Needs py-spy (`pip install py-spy`; it reads the processes
from outside, so their own CPU time is barely changed, though the host's spare time is).

    .venv/bin/python tests/benchmarks/profile_vs_vllm.py epd-e+pd --concurrency 16 --prompts 160 --out var/prof/epd
    .venv/bin/python tests/benchmarks/profile_vs_vllm.py --top var/prof/epd/1234.txt
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from libs.model.checkpoints import ensure_checkpoint  # noqa: E402
from tests.benchmarks.peers import vs_vllm  # noqa: E402

FAMILY = "qwen2_5_vl"  # the benchmark's checkpoint (tests/benchmarks/bench_vs_vllm.py)


def top(path: Path, rows: int = 25) -> str:
    """Self and inclusive shares of the frames in one collapsed-stack file."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        total += n
        frames = stack.split(";")
        own[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n
    lines = [f"{total} samples", "-- self --"]
    lines += [f"{100 * n / total:5.1f}% {f}" for f, n in own.most_common(rows)]
    lines += ["-- inclusive --"] + [f"{100 * n / total:5.1f}% {f}" for f, n in inclusive.most_common(rows)]
    return "\n".join(lines)


def processes(pids: list[int]) -> dict[int, str]:
    found: dict[int, str] = {}
    for pid in pids:
        try:
            process = psutil.Process(pid)
            for p in [process, *process.children(recursive=True)]:
                found[p.pid] = " ".join(p.cmdline())[:200]
        except psutil.NoSuchProcess:
            continue
    return found


def cpu_s(pid: int) -> float:
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.NoSuchProcess:
        return float("nan")
    return float(times.user + times.system)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", choices=vs_vllm.CONFIGS)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=160)
    parser.add_argument("--dataset", default="1img", choices=list(vs_vllm.DATASETS))
    parser.add_argument("--seconds", type=int, default=60, help="py-spy's bound (it stops when the load ends)")
    parser.add_argument("--rate", type=int, default=50, help="py-spy's samples per second")
    parser.add_argument("--out", default="var/prof")
    parser.add_argument("--top", default="", help="print the top frames of one collapsed-stack file and exit")
    ns = parser.parse_args()
    if ns.top:
        print(top(Path(ns.top)))
        return
    if ns.config is None:
        parser.error("a configuration, or --top FILE")
    spy = shutil.which("py-spy")
    if spy is None:
        sys.exit("py-spy is not on PATH: pip install py-spy")
    out = ROOT / ns.out
    out.mkdir(parents=True, exist_ok=True)
    model = ensure_checkpoint(FAMILY, "tiny")
    dataset = vs_vllm.DATASETS[ns.dataset]
    run_dir = ROOT / "var/run/profile" / ns.config.replace("/", "_")
    with vs_vllm.deployed(ns.config, model, run_dir, vs_vllm.Engine(), 420) as dep:
        common = dict(base_url=dep.base_url, model=dep.model, tokenizer=str(model), result_dir=out / "results")
        warm = vs_vllm.Point(ns.dataset, 2, 4, seed=7)
        argv = vs_vllm.bench_serve_args(dataset=dataset, point=warm, filename="warmup.json", **common)
        vs_vllm.bench_serve(argv, out / "warmup.log", 300)
        names = processes(dep.pids())
        (out / "pids.json").write_text(json.dumps(names, indent=1) + "\n")
        point = vs_vllm.Point(ns.dataset, ns.concurrency, ns.prompts, seed=2000)
        argv = vs_vllm.bench_serve_args(dataset=dataset, point=point, filename="point.json", **common)
        before = {pid: cpu_s(pid) for pid in names}
        spies = [
            subprocess.Popen(
                [spy, "record", "--nonblocking", "-r", str(ns.rate), "-d", str(ns.seconds), "--format", "raw",
                 "-o", str(out / f"{pid}.txt"), "-p", str(pid)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            for pid in names
        ]  # fmt: skip
        started = time.monotonic()
        vs_vllm.bench_serve(argv, out / "point.log", 600)
        wall = time.monotonic() - started
        used = {pid: cpu_s(pid) - before[pid] for pid in names}
        for process in spies:
            process.send_signal(signal.SIGINT)  # the load is over: py-spy writes what it sampled
            process.wait(timeout=60)
    result = json.loads((out / "results" / "point.json").read_text())
    summary = {
        "config": ns.config,
        "point": vars(point),
        "wall_s": wall,
        "metrics": vs_vllm.metrics_of(result),
        "cpu_s": {f"{pid} {names[pid][:100]}": round(s, 2) for pid, s in sorted(used.items(), key=lambda x: -x[1])},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
