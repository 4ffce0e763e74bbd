"""Run an EPD service (unchanged) with a call recorder that a signal switches on and off:

    python -m tests.benchmarks.callpath_probe --name NAME --out DIR MODULE [ARGS...]

Before the service's module runs, `sys.setprofile` (this thread) and `threading.setprofile` (every
thread started later: compute threads, executors, transfer threads) install one profile function.
While recording is off it returns at once. SIGUSR1 switches recording on (then `DIR/NAME.PID.on`
exists); SIGUSR2 switches it off and writes `DIR/NAME.PID.json` (written whole, then renamed).
`DIR/NAME.PID.ready` says a process carries the recorder: only those may be signalled (SIGUSR1
kills a process without a handler). A child process carries it too, starting empty and announcing
itself with a ready file of its own PID: a forked child inherits it, and a spawned one (vLLM's
EngineCore and Worker on CPU) runs `spawned()` first, through `multiprocessing.spawn`'s command line.

What is recorded, for Python functions whose code lies in a project file (under `libs/` or
`services/` of this repository; generated `*_pb2*` code and this tool excluded):
- `entered`: per file, how many times one of its functions was entered;
- `edges`: per (caller file, callee file, callee function) with caller file != callee file and
  both project files, how many calls. The caller is the frame that made the call (`f_back`): a
  call through a library frame (a decorator, `contextlib`, `run_in_executor`, the event loop)
  has a library caller and is not an edge;
- `via`: the same triples for calls whose direct caller is a library frame, attributed to the
  nearest project frame below it on the same thread's stack (at most `VIA_DEPTH` library frames,
  never across an event loop, executor or thread start: a hand-off, not a call): `with x.y():`
  through `contextlib`, `module(...)` through torch's `Module.__call__`, a decorator of a library.
A generator or coroutine is counted when it is first entered, not each time it is resumed.

Only a measurement harness (tests/benchmarks/callpath.py starts it); no service imports it.
"""

from __future__ import annotations

import dis
import json
import os
import runpy
import signal
import sys
import threading
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PROJECT_TOPS = ("libs", "services")
_GENERATOR_FLAGS = 0x20 | 0x80 | 0x200  # CO_GENERATOR, CO_COROUTINE, CO_ASYNC_GENERATOR
VIA_DEPTH = 8
# Library frames a call chain does not cross: below them the stack is a scheduler's, not a caller's.
HAND_OFFS = ("/asyncio/", "/concurrent/futures/", "/threading.py", "/multiprocessing/", "/runpy.py")
_SELF = {Path(__file__).resolve(), Path(__file__).resolve().with_name("callpath.py")}


def project_file(filename: str, root: Path = ROOT) -> str:
    """`filename` relative to the repository root when it is a project file, else ""."""
    if not filename or filename.startswith("<"):
        return ""
    try:
        path = Path(os.path.realpath(filename))
        rel = path.relative_to(root)
    except ValueError:
        return ""
    if path in _SELF or not rel.parts or rel.parts[0] not in PROJECT_TOPS or "_pb2" in rel.name:
        return ""
    return rel.as_posix()


def _first_resume(code: types.CodeType) -> int:
    """Offset at which a generator's frame is first entered (its first RESUME)."""
    for instruction in dis.get_instructions(code):
        if instruction.opname == "RESUME":
            return instruction.offset
    return -1


class Recorder:
    """The profile function and what it has seen; one per process."""

    def __init__(self, name: str, out: Path, root: Path = ROOT) -> None:
        self.name = name
        self.out = out
        self.root = root
        self.on = False
        self.entered: dict[str, int] = {}
        self.edges: dict[tuple[str, str, str], int] = {}
        self.via: dict[tuple[str, str, str], int] = {}
        self.threads: dict[str, int] = {}
        self._files: dict[str, str] = {}
        self._resume: dict[types.CodeType, int] = {}
        # Reentrant: a signal handler (start, stop) may run inside `profile` on the main thread.
        self._lock = threading.RLock()

    def _file(self, filename: str) -> str:
        rel = self._files.get(filename)
        if rel is None:
            rel = self._files[filename] = project_file(filename, self.root)
        return rel

    def profile(self, frame: types.FrameType, event: str, arg: Any) -> None:
        if not self.on or event != "call":
            return
        code = frame.f_code
        callee = self._file(code.co_filename)
        if not callee:
            return
        if code.co_flags & _GENERATOR_FLAGS:
            first = self._resume.get(code)
            if first is None:
                first = self._resume[code] = _first_resume(code)
            if frame.f_lasti != first:
                return  # a resumption, not a call
        back = frame.f_back
        caller = self._file(back.f_code.co_filename) if back is not None else ""
        via = "" if caller or back is None else self._through_library(back)
        thread = threading.current_thread().name
        with self._lock:
            self.entered[callee] = self.entered.get(callee, 0) + 1
            self.threads[thread] = self.threads.get(thread, 0) + 1
            if caller and caller != callee:
                key = (caller, callee, code.co_qualname)
                self.edges[key] = self.edges.get(key, 0) + 1
            elif via and via != callee:
                key = (via, callee, code.co_qualname)
                self.via[key] = self.via.get(key, 0) + 1

    def _through_library(self, frame: types.FrameType | None) -> str:
        """The project file of the nearest project frame below library `frame`, or ""."""
        for _ in range(VIA_DEPTH):
            if frame is None:
                return ""
            filename = frame.f_code.co_filename
            rel = self._file(filename)
            if rel:
                return rel
            if any(mark in filename for mark in HAND_OFFS):
                return ""
            frame = frame.f_back
        return ""

    def _path(self, kind: str) -> Path:
        return self.out / f"{self.name}.{os.getpid()}.{kind}"

    def announce(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self._path("ready").write_text(str(os.getppid()))

    def start(self, *_: object) -> None:
        with self._lock:
            self.entered.clear()
            self.edges.clear()
            self.via.clear()
            self.threads.clear()
            self.on = True
        self._path("on").write_text("")

    def stop(self, *_: object) -> None:
        self.on = False
        with self._lock:
            result = self.result()
        target, partial = self._path("json"), self._path("partial")
        partial.write_text(json.dumps(result, indent=1))
        partial.rename(target)

    def result(self) -> dict[str, Any]:
        try:
            comm = Path("/proc/self/comm").read_text().strip()
        except OSError:
            comm = ""
        return {
            "name": self.name,
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "comm": comm,
            "entered": dict(sorted(self.entered.items())),
            "edges": [[*key, count] for key, count in sorted(self.edges.items())],
            "via": [[*key, count] for key, count in sorted(self.via.items())],
            "threads": dict(sorted(self.threads.items())),
        }

    def after_fork(self) -> None:
        self.on = False
        self._lock = threading.RLock()
        self.entered, self.edges, self.via, self.threads = {}, {}, {}, {}
        self.announce()

    def _spawn_through_probe(self) -> None:
        """Make processes `multiprocessing` spawns install a recorder of their own first."""
        from multiprocessing import spawn

        original = spawn.get_command_line

        def command_line(**kwds: Any) -> list[str]:
            line = list(original(**kwds))
            if "-c" in line:
                at = line.index("-c") + 1
                line[at] = f"import {__spec__.name} as p; p.spawned({self.name!r}, {str(self.out)!r}); {line[at]}"
            return line

        spawn.get_command_line = command_line

    def install(self) -> None:
        signal.signal(signal.SIGUSR1, self.start)
        signal.signal(signal.SIGUSR2, self.stop)
        os.register_at_fork(after_in_child=self.after_fork)
        self._spawn_through_probe()
        self.announce()
        threading.setprofile(self.profile)
        sys.setprofile(self.profile)


def spawned(name: str, out: str) -> None:
    """In a process `multiprocessing` spawned from a probed one, before its target runs."""
    Recorder(name, Path(out)).install()


def main(argv: list[str]) -> None:
    args = argv[1:]
    name, out = "", Path()
    while args and args[0].startswith("--"):
        option = args.pop(0)
        if option == "--name":
            name = args.pop(0)
        elif option == "--out":
            out = Path(args.pop(0))
        else:
            raise SystemExit(f"unknown option {option}")
    if not name or not args:
        raise SystemExit("usage: python -m tests.benchmarks.callpath_probe --name NAME --out DIR MODULE [ARGS...]")
    Recorder(name, out.resolve()).install()
    module, *rest = args
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv)
