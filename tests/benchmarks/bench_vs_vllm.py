"""Benchmark (not a test; `make bench-vs-vllm`): EPD on vLLM behind the OpenAI door against vLLM's
own E+PD, P/D split and unsplit `vllm serve`, measured by vLLM's own `vllm bench serve`
(tests/benchmarks/peers/vs_vllm.py says what each configuration is).

Each configuration runs alone: started, warmed up (a few requests of another seed), every point
measured (dataset x concurrency), stopped by PID; repeats interleaved (A B C A B C ...). Output: a
table printed, and `<out>.json` (every run), `<out>.png` and `<out>.table.md` (by default under var/;
docs/results/bench-vs-vllm.md carries the table of the run of record).

    .venv/bin/python tests/benchmarks/bench_vs_vllm.py --quick
    .venv/bin/python tests/benchmarks/bench_vs_vllm.py --repeats 3 --out var/bench-vs-vllm/run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from libs.model.checkpoints import ensure_checkpoint  # noqa: E402
from tests.benchmarks.peers import vs_vllm  # noqa: E402

# The tiny Qwen2.5-VL checkpoint, as `make bench-vllm`: vLLM serves it with its own vision tower and
# with ECExampleConnector (the tiny Omni one's image embeddings crash vLLM's worker, /work/shared/vllm.md).
FAMILY = "qwen2_5_vl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: c=1,4, 1 repeat, 8 prompts")
    parser.add_argument(
        "--configs",
        default=",".join(vs_vllm.MATRIX),
        help=f"comma-separated, of: {', '.join(vs_vllm.CONFIGS)} (default: the issue's matrix)",
    )
    parser.add_argument("--datasets", default="1img,3img")
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--prompts-at-64", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests/s bench serve sends at most, Poisson arrivals (default: inf, each concurrency slot as soon "
        "as its answer ends): the same offered load for every configuration",
    )
    parser.add_argument(
        "--client-cpus",
        default="",
        help="comma-separated CPUs bench serve runs on, for every configuration alike (default: wherever the OS "
        "puts it; on one host the client takes CPU from whichever server it lands beside)",
    )
    parser.add_argument("--ready-timeout-s", type=float, default=420.0, help="per configuration start")
    parser.add_argument("--point-timeout-s", type=float, default=300.0, help="per bench serve run")
    parser.add_argument(
        "--out",
        default="var/bench-vs-vllm/run",
        help="path prefix for .json/.png/.table.md, relative to the repository (default: %(default)s)",
    )
    parser.add_argument(
        "--from-json",
        default="",
        help="re-read the points of an earlier --out's JSON instead of measuring: its table and files again "
        "(with this version's ratios)",
    )
    parser.add_argument(
        "--from-runs",
        default="",
        help="re-read bench serve's result files under this run folder "
        "(var/run/bench-vs-vllm) instead of measuring: the table and files again",
    )
    ns = parser.parse_args()
    # Stopped (SIGTERM; SIGINT is ignored where a shell runs it in the background), the run unwinds
    # the `with` blocks that stop every server it started: Python's default would leave them running.
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))
    client_cpus = frozenset(int(cpu) for cpu in ns.client_cpus.split(",")) if ns.client_cpus else None
    if ns.quick:
        ns.concurrency, ns.repeats, ns.prompts, ns.prompts_at_64 = "1,4", 1, 8, 8
    configs = [c for c in ns.configs.split(",") if c]
    unknown = [c for c in configs if c not in vs_vllm.CONFIGS]
    if unknown:
        parser.error(f"--configs: unknown {unknown}; known: {', '.join(vs_vllm.CONFIGS)}")
    datasets = [d for d in ns.datasets.split(",") if d]
    if bad := [d for d in datasets if d not in vs_vllm.DATASETS]:
        parser.error(f"--datasets: unknown {bad}; known: {', '.join(vs_vllm.DATASETS)}")
    concurrencies = [int(c) for c in ns.concurrency.split(",") if c]
    pts = vs_vllm.points(datasets, concurrencies, ns.prompts, ns.prompts_at_64, ns.request_rate)
    model = ensure_checkpoint(FAMILY, "tiny")
    engine = vs_vllm.Engine()
    work = ROOT / "var/run/bench-vs-vllm"
    results = vs_vllm.Results()
    runs: list[dict[str, Any]] = []
    notes: dict[str, str] = {}
    started = time.time()
    if ns.from_json:
        earlier = json.loads((ROOT / ns.from_json).read_text())
        for key, value in earlier.get("args", {}).items():  # how it was measured, kept
            if key not in ("out", "from_json", "from_runs"):
                setattr(ns, key, value)
        for config, by_dataset in earlier["points"].items():
            for dataset, by_conc in by_dataset.items():
                for conc, repeats in by_conc.items():
                    for measured in repeats:
                        results.add(config, vs_vllm.Point(dataset, int(conc), 0, 0), measured)
        print(write(ns, model, engine, results, earlier.get("runs", []), earlier.get("notes", {}), final=True))
        return
    if ns.from_runs:
        reread(Path(ns.from_runs), pts, results)
        # The measuring run's own records (starts, PIDs, load) stay when its JSON is the output.
        prior = ROOT / ns.out if ns.out else None
        kept = (
            json.loads(prior.with_suffix(".json").read_text()) if prior and prior.with_suffix(".json").exists() else {}
        )
        print(write(ns, model, engine, results, kept.get("runs", []), kept.get("notes", {}), final=True))
        return
    shutil.rmtree(work, ignore_errors=True)  # the previous measuring run's folders (after --from-runs read them)
    for repeat, config in vs_vllm.schedule(configs, ns.repeats):
        tag = config.replace("/", "_")
        run_dir = work / f"r{repeat}-{tag}"
        record: dict[str, Any] = {"repeat": repeat, "config": config, "load_before": vs_vllm.load_average()}
        t0 = time.monotonic()
        try:
            with vs_vllm.deployed(config, model, run_dir, engine, ns.ready_timeout_s) as dep:
                record["start_s"] = time.monotonic() - t0
                record["pids"] = dep.pids()
                notes[config] = dep.note
                common = dict(base_url=dep.base_url, model=dep.model, tokenizer=str(model),
                              result_dir=run_dir / "results")  # fmt: skip
                warm = vs_vllm.Point(datasets[0], 2, 4, seed=7)
                vs_vllm.bench_serve(
                    vs_vllm.bench_serve_args(dataset=vs_vllm.DATASETS[warm.dataset], point=warm,
                                             filename="warmup.json", **common),  # type: ignore[arg-type]
                    run_dir / "warmup.log", ns.point_timeout_s, client_cpus)  # fmt: skip
                for point in pts:
                    name = f"{point.dataset}-c{point.concurrency}.json"
                    argv = vs_vllm.bench_serve_args(dataset=vs_vllm.DATASETS[point.dataset], point=point,
                                                    filename=name, **common)  # type: ignore[arg-type]  # fmt: skip
                    try:
                        out = vs_vllm.bench_serve(argv, run_dir / f"{name}.log", ns.point_timeout_s, client_cpus)
                        path = run_dir / "results" / name
                        if out.returncode != 0 or not path.exists():
                            raise RuntimeError(f"bench serve exit {out.returncode}: {out.stderr[-400:]}")
                        metrics: dict[str, Any] = vs_vllm.metrics_of(json.loads(path.read_text()))
                        if metrics["failed"]:
                            errors = json.loads(path.read_text()).get("errors") or []
                            metrics["first_error"] = next((e for e in errors if e), "")[:300]
                    except (RuntimeError, subprocess.TimeoutExpired) as exc:
                        metrics = {"error": str(exc)[-400:]}
                    metrics["load"] = vs_vllm.load_average()[0]
                    results.add(config, point, metrics)
                    print(f"[{time.time() - started:6.0f}s] r{repeat} {config} {point.dataset} c={point.concurrency}: "
                          + (metrics.get("error") or
                             f"TTFT p50 {metrics['median_ttft_ms']:.1f} ms, {metrics['output_throughput']:.0f} tok/s, "
                             f"failed {metrics['failed']:.0f}"), flush=True)  # fmt: skip
        except Exception as exc:  # a configuration that cannot start here is a result too
            record["error"] = f"{type(exc).__name__}: {str(exc)[-1500:]}"
            results.errors.setdefault(config, []).append(record["error"])
            print(f"r{repeat} {config}: FAILED {record['error'][-600:]}", flush=True)
        record["wall_s"] = time.monotonic() - t0
        record["load_after"] = vs_vllm.load_average()
        runs.append(record)
        write(ns, model, engine, results, runs, notes, final=False)
    text = write(ns, model, engine, results, runs, notes, final=True)
    print(text)
    for config, errs in results.errors.items():
        print(f"{config} failed {len(errs)}x: {errs[-1][-600:]}")


def reread(folder: Path, pts: list[vs_vllm.Point], results: vs_vllm.Results) -> None:
    """Results from the result files a measuring run left (folders `r<repeat>-<config>`)."""
    names = {c.replace("/", "_"): c for c in vs_vllm.CONFIGS}
    for run_dir in sorted(folder.glob("r*-*"), key=lambda p: int(p.name[1:].split("-", 1)[0])):
        config = names.get(run_dir.name.split("-", 1)[1])
        if config is None:
            continue
        for point in pts:
            path = run_dir / "results" / f"{point.dataset}-c{point.concurrency}.json"
            # A point without its file stays in place (NaN), so ratios still pair by repeat.
            found = vs_vllm.metrics_of(json.loads(path.read_text())) if path.exists() else {"error": "no result file"}
            results.add(config, point, found)


def write(
    ns: argparse.Namespace,
    model: Path,
    engine: vs_vllm.Engine,
    results: vs_vllm.Results,
    runs: list[dict[str, Any]],
    notes: dict[str, str],
    *,
    final: bool,
) -> str:
    """The table, and with --out the files: after every run (an interrupted run keeps what it
    measured; `complete` says whether the whole schedule ran)."""
    summary = results.summary()
    text = vs_vllm.table(summary)
    if ns.out:
        out = ROOT / ns.out
        out.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "complete": final,
            "host": {"cpus": os.cpu_count(), "platform": platform.platform()},
            "checkpoint": f"{FAMILY} tiny ({model.name})",
            "engine": vars(engine),
            "args": vars(ns),
            "notes": notes,
            "runs": runs,
            "points": results.runs,
            "errors": results.errors,
            "summary": summary,
        }
        out.with_suffix(".json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
        out.with_suffix(".table.md").write_text(text + "\n")
        vs_vllm.plot(summary, out.with_suffix(".png"))
        if final:
            print(f"wrote {out}.json, {out}.table.md, {out}.png")
    return text


if __name__ == "__main__":
    main()
