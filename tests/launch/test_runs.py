"""One directory per stack run (libs/launch/runs.py): each run of a run directory gets its own,
named by its UTC start, with a manifest saying where its spans go; `latest` points at the newest;
runs sharing one span file (an explicit --trace-file) are told apart by their start times; a run
is live while its launcher holds the run directory."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from libs.launch import rundir, runs

pytestmark = pytest.mark.unit


def test_each_run_gets_a_directory_of_its_own_and_latest_points_at_the_newest(tmp_path: Path) -> None:
    run_dir = tmp_path / "stack"
    first = runs.start(run_dir, None, spans=True)
    second = runs.start(run_dir, None, spans=True)  # the same second, most likely: a suffix tells them apart
    assert first.dir != second.dir and first.dir.parent == second.dir.parent == (run_dir / runs.RUNS_DIR).resolve()
    assert re.fullmatch(r"\d{8}-\d{6}(-\d+)?", second.id), second.id
    assert first.trace_file == first.dir / runs.SPANS and second.trace_file == second.dir / runs.SPANS
    assert (run_dir / runs.LATEST).resolve() == second.dir
    assert runs.latest(run_dir) == second
    assert runs.every(run_dir) == [first, second]
    manifest = json.loads((second.dir / runs.MANIFEST).read_text())
    assert manifest == {"started_ns": second.started_ns, "pid": os.getpid(), "trace_file": str(second.trace_file)}


def test_a_run_without_a_span_file_says_so(tmp_path: Path) -> None:
    run = runs.start(tmp_path, None, spans=False)  # --trace-exporter otlp / none
    assert run.trace_file is None and runs.load(run.dir) == run


def test_runs_sharing_a_span_file_are_told_apart_by_their_start(tmp_path: Path) -> None:
    shared = tmp_path / "spans.jsonl"
    one = runs.start(tmp_path / "stack", shared, spans=True)
    own = runs.start(tmp_path / "stack", None, spans=True)  # its own file: does not end the first's window
    two = runs.start(tmp_path / "stack", shared, spans=True)
    every = runs.every(tmp_path / "stack")
    assert one.trace_file == two.trace_file == shared.resolve()
    assert runs.window(one, every) == (one.started_ns, two.started_ns)
    assert runs.window(own, every) == (own.started_ns, None)
    assert runs.window(two, every) == (two.started_ns, None)


def test_a_run_is_live_while_its_launcher_holds_the_directory(tmp_path: Path) -> None:
    lock = rundir.acquire(tmp_path)
    run = runs.start(tmp_path, None, spans=True)
    assert runs.live(tmp_path, run)
    lock.release()
    assert not runs.live(tmp_path, run)
    assert (tmp_path / runs.LATEST).exists()  # the run's logs stay; so does the way to them


def test_what_is_not_a_run_is_named(tmp_path: Path) -> None:
    (tmp_path / runs.RUNS_DIR / "notes").mkdir(parents=True)
    assert runs.every(tmp_path) == [] and runs.latest(tmp_path) is None
    with pytest.raises(runs.RunError, match="not a run's directory"):
        runs.load(tmp_path / runs.RUNS_DIR / "notes")
