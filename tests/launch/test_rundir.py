"""One stack per run directory (libs/launch/rundir.py): a held directory is refused with the
holder's PID and the `--run-dir` way out, a lock left by a killed launcher is taken over with a
note, and releasing removes only what the stack wrote."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from libs.launch import rundir

pytestmark = pytest.mark.unit


def _dead_pid() -> int:
    """The PID of a process that has exited (what a killed `epd up` leaves in its lock)."""
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    return done.pid


def test_a_held_directory_is_refused_naming_the_holder_and_the_way_out(tmp_path: Path) -> None:
    lock = rundir.acquire(tmp_path / "run")
    try:
        with pytest.raises(rundir.RunDirInUse) as refused:
            rundir.acquire(tmp_path / "run")  # another open file: flock refuses it as it would another process
        message = str(refused.value)
        assert str(tmp_path / "run") in message and "PID" in message
        assert f"--run-dir {tmp_path / 'run-2'}" in message
        assert rundir.holder(tmp_path / "run") is not None
    finally:
        lock.release()
    rundir.acquire(tmp_path / "run").release()  # free again


def test_a_lock_left_by_a_killed_launcher_is_taken_over_with_a_note(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    dead = _dead_pid()
    (run_dir / rundir.LOCK_FILE).write_text(f"{dead}\n")
    assert rundir.holder(run_dir) is None
    lock = rundir.acquire(run_dir)
    try:
        assert f"PID {dead}" in lock.note and "no longer runs" in lock.note
    finally:
        lock.release()
    assert not (run_dir / rundir.LOCK_FILE).exists()


def test_release_removes_only_what_the_stack_wrote(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("the user's")
    lock = rundir.acquire(run_dir)
    lock.write(run_dir / "router.address", "127.0.0.1:1")
    lock.write(run_dir / "other.address", "127.0.0.1:2")
    (run_dir / "other.address").write_text("127.0.0.1:3")  # rewritten by someone else since
    lock.release()
    assert sorted(p.name for p in run_dir.iterdir()) == ["notes.txt", "other.address"]
