"""One stack per run directory.

A stack's run directory holds what its clients find it by (the router address file, the TLS
material) and its logs; two stacks in one directory would overwrite each other's address, and the
first to stop would delete the address of the one still running. So `epd up` (and the demos) hold
`RUN_DIR/epd.lock` while they run: an exclusive `flock` on it (released by the kernel however the
holder ends, so a killed stack never blocks the directory) and its PID inside, for the messages. A
second launcher in the same directory is refused with the holder's PID and the `--run-dir` way out;
a lock file left by a killed stack (no one holds the flock) is taken over, with a note saying so.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from dataclasses import dataclass, field
from pathlib import Path

LOCK_FILE = "epd.lock"


class RunDirInUse(Exception):
    """Another running launcher holds the run directory."""

    def __init__(self, run_dir: Path, pid: int | None) -> None:
        holder = f"PID {pid}" if pid is not None else "a process whose PID the lock does not name"
        super().__init__(
            f"{run_dir} is in use by another running stack ({holder}): stop it first (Ctrl-C where it runs), "
            f"or give this one a directory of its own: --run-dir {_sibling(run_dir)}"
        )
        self.run_dir = run_dir
        self.pid = pid


def _sibling(run_dir: Path) -> Path:
    """A free directory next to `run_dir` to suggest (var/run/stack -> var/run/stack-2)."""
    n = 2
    while holder(candidate := run_dir.with_name(f"{run_dir.name}-{n}")) is not None:
        n += 1
    return candidate


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True


def holder(run_dir: Path) -> int | None:
    """The PID of the launcher running a stack in `run_dir`, or None when none runs there (no lock
    file, or one whose process is gone). Reads only: it never takes the lock itself, which would
    make a launcher starting at that instant think the directory is in use."""
    pid = _read_pid(run_dir / LOCK_FILE)
    return pid if pid is not None and _alive(pid) else None


@dataclass
class RunDirLock:
    """A held run directory; `release()` (or process exit) frees it."""

    run_dir: Path
    fd: int
    note: str = ""  # what was taken over, if anything: for the launcher to print
    created: dict[Path, str] = field(default_factory=dict)  # files this stack wrote -> what it wrote

    @property
    def path(self) -> Path:
        return self.run_dir / LOCK_FILE

    def write(self, path: Path, content: str) -> None:
        """Write a file clients read while the stack runs (the router address); `release` removes
        it, unless something else has rewritten it since."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
        self.created[path] = content

    def release(self) -> None:
        """Remove what this stack created (where it still holds what the stack wrote), then the lock."""
        for path, content in self.created.items():
            with contextlib.suppress(OSError):
                if path.read_text() == content:
                    path.unlink()
        self.created.clear()
        if self.fd < 0:
            return
        with contextlib.suppress(OSError):
            if os.fstat(self.fd).st_ino == os.stat(self.path).st_ino:
                self.path.unlink()  # ours: before the flock goes, so no one locks a file about to vanish
        os.close(self.fd)
        self.fd = -1


def acquire(run_dir: Path) -> RunDirLock:
    """Hold `run_dir` for one stack; RunDirInUse when another live launcher holds it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    note = ""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunDirInUse(run_dir, _read_pid(path)) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # the holder removed it between our open and our flock: lock the new one
            os.close(fd)
            continue
        break
    previous = _read_pid(path)
    if previous is not None and previous != os.getpid():
        state = "no longer runs" if not _alive(previous) else "runs but no longer holds it"
        note = f"took over {path}: the stack of PID {previous} left it ({state}; killed, not stopped)"
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return RunDirLock(run_dir, fd, note)
