"""A checkout of a released commit, for tests that run an older release's services beside this one
(cross-version handoffs, rolling upgrades). Found by its commit message; a shallow clone (as some
CI systems make) lacks it, so the history is fetched rather than the test skipped."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from libs.launch.process import ROOT


def _git(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _commit(message: str) -> str:
    return _git("log", "--format=%H", f"--grep={message}", "-1").stdout.strip()


@contextmanager
def release_checkout(message: str, parent: Path) -> Iterator[Path]:
    """A detached worktree at the commit whose message contains `message`, under `parent`."""
    commit = _commit(message)
    if not commit and _git("rev-parse", "--is-shallow-repository").stdout.strip() == "true":
        _git("fetch", "--unshallow", "--quiet", timeout=300)
        commit = _commit(message)
    if not commit:
        pytest.fail(f"no commit '{message}' in this clone's history")
    path = parent / "epd"
    subprocess.run(["git", "worktree", "add", "--detach", str(path), commit], cwd=ROOT, check=True, capture_output=True)
    try:
        yield path
    finally:
        _git("worktree", "remove", "--force", str(path))
        _git("worktree", "prune")
