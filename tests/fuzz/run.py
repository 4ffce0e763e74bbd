"""Coverage-guided fuzzing with atheris (libFuzzer), bounded in time.

    python -m tests.fuzz.run TARGET [--seconds 60] [--corpus DIR] [--found DIR]
    python -m tests.fuzz.run all [--seconds 60]     # each target in turn (`make fuzz`), then a table

The corpus starts from the target's seeds and grows in `var/fuzz/corpus/TARGET`; an input that
raises an untyped exception, hangs past `--timeout` seconds or exceeds the memory bound is written
to `var/fuzz/found/TARGET/` and the run exits non-zero. Turn each find into a regression case:
copy it under `tests/fuzz/regressions/TARGET/`, fix the code, and `make test` replays it forever.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import atheris

_DONE = re.compile(r"^#(\d+)\s+DONE\s+cov: (\d+) ft: (\d+) corp: (\d+)/", re.MULTILINE)
_EXEC = re.compile(r"stat::average_exec_per_sec:\s+(\d+)")


def run_all(seconds: int) -> int:
    """Fuzz every target in its own process (libFuzzer owns the process); print what each did."""
    from tests.support.fuzz_targets import TARGETS

    rows, failed = [], []
    for name in TARGETS:
        found = Path("var/fuzz/found") / name
        before = set(found.iterdir()) if found.is_dir() else set()
        done = subprocess.run(
            [sys.executable, "-m", "tests.fuzz.run", name, "--seconds", str(seconds)],
            capture_output=True,
            text=True,
        )
        log = done.stdout + done.stderr
        finds = sorted(set(found.iterdir()) - before) if found.is_dir() else []
        stats = _DONE.search(log)
        speed = _EXEC.search(log)
        runs, cov, features, corpus = stats.groups() if stats else ("-", "-", "-", "-")
        rows.append((name, runs, speed.group(1) if speed else "-", cov, features, corpus, len(finds)))
        if done.returncode != 0 or finds:
            failed.append(name)
            print(f"== {name}: exit {done.returncode}; finds: {[str(f) for f in finds]}\n{log[-3000:]}")
    print(f"{'target':<12} {'runs':>9} {'exec/s':>7} {'cov':>5} {'features':>8} {'corpus':>6} {'finds':>5}")
    for row in rows:
        print(f"{row[0]:<12} {row[1]:>9} {row[2]:>7} {row[3]:>5} {row[4]:>8} {row[5]:>6} {row[6]:>5}")
    print(f"{seconds} s per target; crashes, hangs and untyped exceptions: {', '.join(failed) or 'none'}")
    return 1 if failed else 0


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz.run")
    parser.add_argument("target")
    parser.add_argument("--seconds", type=int, default=60, help="total fuzzing time")
    parser.add_argument("--timeout", type=int, default=20, help="seconds one input may take (a hang)")
    parser.add_argument("--rss-mib", type=int, default=4096, help="memory bound of the fuzzing process")
    parser.add_argument("--corpus", type=Path, default=None)
    parser.add_argument("--found", type=Path, default=None)
    ns = parser.parse_args()
    if ns.target == "all":
        sys.exit(run_all(ns.seconds))

    # Instrument the project's code (not the libraries') as it loads: the targets import what they
    # exercise lazily, so run every seed once inside the instrumented import context.
    with atheris.instrument_imports(include=["libs", "tests.fuzz"]):
        from tests.support.fuzz_targets import TARGETS, call, target

        if ns.target not in TARGETS:
            parser.error(f"unknown target {ns.target!r}; one of {', '.join(TARGETS)}")
        chosen = target(ns.target)
        seeds = list(chosen.seeds())
        for seed in seeds:
            call(chosen, seed)

    corpus = ns.corpus or Path("var/fuzz/corpus") / ns.target
    found = ns.found or Path("var/fuzz/found") / ns.target
    corpus.mkdir(parents=True, exist_ok=True)
    found.mkdir(parents=True, exist_ok=True)
    for i, seed in enumerate(seeds):
        (corpus / f"seed-{i}").write_bytes(seed)
    args = [
        sys.argv[0],
        str(corpus),
        f"-max_total_time={ns.seconds}",
        f"-timeout={ns.timeout}",
        f"-rss_limit_mb={ns.rss_mib}",
        f"-artifact_prefix={found}/",
        "-print_final_stats=1",
    ]
    atheris.Setup(args, lambda data: call(chosen, data))
    atheris.Fuzz()


if __name__ == "__main__":
    main()
