"""One directory per stack run: that run's logs and spans, apart from every other run's.

A run directory (`--run-dir`, libs/launch/rundir.py) is a stack's home across its runs: the lock,
the router address and the TLS material its clients read. Each run of a launcher there (`epd up`,
`epd demo`) gets `RUN_DIR/runs/<id>/`, the id its UTC start time (`20261207-225700`; `-2`, ...
after it when one second holds two), with every service's logs (`<name>.log`, JSON lines only;
`<name>.native.log`, the process's own output: libs/launch/process.py), the Mooncake Store's logs
under `store/`, the run's spans (`spans.jsonl`, unless `--trace-file` sends them elsewhere) and
`run.json`: when it started, the launcher's PID, where its spans go. `RUN_DIR/latest` links to the
newest run, so `jq . var/run/stack/latest/router.log` reads the current one and `epd trace report`
reports it by default, rather than every request a span file ever collected.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from libs.launch.rundir import holder

RUNS_DIR = "runs"
LATEST = "latest"
MANIFEST = "run.json"
SPANS = "spans.jsonl"


class RunError(Exception):
    """A run's directory cannot be read (no manifest, or not one this version wrote)."""


@dataclass(frozen=True)
class Run:
    """One run of a stack."""

    dir: Path
    started_ns: int  # the launcher's start, wall clock (spans of the run's requests start later)
    pid: int  # the launcher's
    trace_file: Path | None  # where its services write spans (JSONL); None: they export elsewhere or not at all

    @property
    def id(self) -> str:
        return self.dir.name

    def to_json(self) -> str:
        trace_file = None if self.trace_file is None else str(self.trace_file)
        return json.dumps({"started_ns": self.started_ns, "pid": self.pid, "trace_file": trace_file}, indent=1)


def _new_dir(run_dir: Path, now_s: float) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now_s))
    runs = run_dir / RUNS_DIR
    runs.mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        candidate = runs / (stamp if n == 1 else f"{stamp}-{n}")
        with contextlib.suppress(FileExistsError):
            candidate.mkdir()
            return candidate
    raise RunError(f"{runs} already holds 999 runs started at {stamp}")


def _point_latest(run_dir: Path, run: Path) -> None:
    """RUN_DIR/latest -> runs/<id>, replaced in one step (a reader never finds it missing)."""
    link = run_dir / LATEST
    staging = run_dir / f".{LATEST}.{os.getpid()}"
    staging.unlink(missing_ok=True)
    staging.symlink_to(run.relative_to(run_dir))
    os.replace(staging, link)


def start(run_dir: Path, trace_file: Path | None, spans: bool) -> Run:
    """A new run of the stack in `run_dir` (which its launcher holds): its directory, its manifest,
    `latest` pointing at it. `spans`: its services write JSONL spans, to `trace_file` or, None, to
    the run's own `spans.jsonl`."""
    now_ns = time.time_ns()
    directory = _new_dir(run_dir, now_ns / 1e9)
    if spans:
        trace_file = (trace_file or directory / SPANS).resolve()
    run = Run(directory.resolve(), now_ns, os.getpid(), trace_file if spans else None)
    (directory / MANIFEST).write_text(run.to_json() + "\n")
    _point_latest(run_dir, directory)
    return run


def load(directory: Path) -> Run:
    """The run whose directory this is."""
    try:
        raw = json.loads((directory / MANIFEST).read_text())
        trace_file = raw["trace_file"]
        return Run(directory.resolve(), int(raw["started_ns"]), int(raw["pid"]), trace_file and Path(trace_file))
    except FileNotFoundError:
        raise RunError(f"{directory} is not a run's directory (no {MANIFEST})") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise RunError(f"{directory / MANIFEST} is not a run manifest: {exc}") from None


def every(run_dir: Path) -> list[Run]:
    """Every run of `run_dir`, oldest first; directories that are not runs are left out."""
    found = []
    for directory in sorted((run_dir / RUNS_DIR).glob("*")):
        with contextlib.suppress(RunError, NotADirectoryError):
            found.append(load(directory))
    return sorted(found, key=lambda r: r.started_ns)


def latest(run_dir: Path) -> Run | None:
    """The newest run of `run_dir` (what `latest` points at), None when it has none."""
    link = run_dir / LATEST
    if link.exists():
        with contextlib.suppress(RunError):
            return load(link.resolve())
    runs = every(run_dir)
    return runs[-1] if runs else None


def window(run: Run, runs: list[Run]) -> tuple[int, int | None]:
    """The wall-clock span [start, end) of `run`'s requests in its trace file: from its start to the
    start of the next run writing to the same file (None: open), for span files several runs share
    (an explicit `--trace-file`)."""
    later = [r.started_ns for r in runs if r.started_ns > run.started_ns and r.trace_file == run.trace_file]
    return run.started_ns, min(later) if later else None


def shown(path: Path) -> Path:
    """`path` as a user would type it: relative to the working directory when inside it (runs keep
    absolute paths: their services run elsewhere)."""
    try:
        return path.relative_to(Path.cwd())
    except ValueError:
        return path


def live(run_dir: Path, run: Run) -> bool:
    """Whether `run`'s launcher still holds `run_dir`: its stack is up, its services still writing."""
    return holder(run_dir) == run.pid
