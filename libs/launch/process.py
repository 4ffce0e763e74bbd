"""One service process: spawn `python -m services.<name>`, wait until it listens, stop it by PID.

The service prints `<name> listening on HOST:PORT` to stdout once its server is up (it binds port 0
by default, so there is no port race). Two files per service: `<name>.log`, its JSON log lines
only (the launcher names it in `EPD_LOG_FILE`, libs/telemetry/logging.py), and
`<name>.native.log`, the process's stdout and stderr: the listening line the launcher polls for,
and what does not come through the service's logger (native libraries' own output such as
Mooncake's glog or UCX, vLLM's log lines, a crash's traceback). So every line of `<name>.log`
parses as JSON, and the native output is kept rather than dropped. A service of an older checkout
(no EPD_LOG_FILE) logs to stderr: its JSON lines land in the native file, and are found there.
Stopping sends SIGTERM (the service drains within its grace period), then SIGKILL after a timeout.
Each service leads a process group of its own; once it has exited, whatever is left of that group
is killed too: processes the service started and did not stop (a vLLM engine core outlives a
service that was SIGKILLed, and would keep its memory and a busy core).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from libs.telemetry.logging import LOG_FILE_ENV

# "<service> listening on HOST:PORT" alone on a line (libs/rpc/main.py); anchored, because libraries
# the service loads (Mooncake) log "listening on" lines of their own.
_LISTENING = re.compile(r"^[a-z_]+ listening on (\S+:\d+)$", re.MULTILINE)
ROOT = Path(__file__).resolve().parents[2]
NATIVE_SUFFIX = ".native.log"


def native_log_path(log_path: Path) -> Path:
    """Where the process's stdout and stderr go beside its JSON log: router.log -> router.native.log."""
    return log_path.with_name(log_path.name.removesuffix(".log") + NATIVE_SUFFIX)


def free_port() -> int:
    """A loopback TCP port free right now (for services started with a fixed --port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def set_session_nice(nice: int, attempts: int = 50) -> bool:
    """Give the calling process's session the nice value `nice` (Linux autogroups).

    Where the kernel groups tasks by session (`/proc/sys/kernel/sched_autogroup_enabled`), the CPU is
    shared between sessions first and a task's own nice counts only inside its session: a service
    started in a session of its own (`start_new_session`) at nice 19 still takes half a core from a
    nice-0 engine in another session, and delays its wake-ups by up to a scheduler slice. The
    session's nice is what ranks it against the others. Non-root writers are limited to one write
    per 100 ms host-wide (EAGAIN): retried for up to `attempts` x 20 ms. False where the kernel has
    no autogroups or refused; the task's own nice then is all there is."""
    for _ in range(attempts):
        try:
            with open("/proc/self/autogroup", "w") as f:
                f.write(str(nice))
            return True
        except BlockingIOError:
            time.sleep(0.02)
        except OSError:
            return False
    return False


def session_nice(pid: int) -> int | None:
    """The nice value of `pid`'s session (`set_session_nice`); None where there are no autogroups."""
    try:
        text = Path(f"/proc/{pid}/autogroup").read_text()
    except OSError:
        return None
    match = re.search(r"nice (-?\d+)", text)
    return int(match.group(1)) if match else None


class LaunchError(RuntimeError):
    """A service process did not come up; the message carries the tail of its log."""


@dataclass
class ServiceProcess:
    """A started service process."""

    name: str
    module: str
    args: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    # The source tree to run the service from (another checkout runs another version).
    root: Path = ROOT
    # A network namespace to run it in (`ip netns exec`, which execs: the PID is the service's).
    netns: str | None = None
    # Placement on the host (libs/launch/placement.py): the CPUs the process and its children run
    # on, and its nice value. None / 0: the launcher's own.
    cpus: frozenset[int] | None = None
    nice: int = 0
    process: subprocess.Popen[bytes] | None = None
    address: str = ""
    # Incarnations so far (a supervisor restarts a dead process with the same args).
    starts: int = field(default=0, init=False)
    started_at: float = field(default=0.0, init=False)  # time.monotonic() of the current start
    ready_at: float = field(default=0.0, init=False)  # ... and of its "listening" line (0: not yet)
    _log_offset: int = field(default=0, init=False, repr=False)  # where this incarnation's output begins

    @property
    def native_log_path(self) -> Path:
        """The process's stdout and stderr (its listening line, native libraries' output)."""
        return native_log_path(self.log_path)

    def start(self) -> None:
        """Start (or restart: the logs are appended to, the same arguments and port are used)."""
        self._end_group()  # a previous incarnation's leftovers
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        native = self.native_log_path
        self._log_offset = native.stat().st_size if self.starts and native.exists() else 0
        if not self.starts:
            self.log_path.write_bytes(b"")  # a fresh log per launch; the service appends to it
        # The service stops itself if this process dies without stopping it (libs/rpc/main.py).
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "EPD_PARENT_PID": str(os.getpid()), **self.env}
        env[LOG_FILE_ENV] = str(self.log_path.resolve())  # the service runs in `root`, not here
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(self.root), env.get("PYTHONPATH", "")) if p)
        command = [sys.executable, "-m", self.module, *self.args]
        if self.netns is not None:
            command = ["ip", "netns", "exec", self.netns, *command]
        with native.open("ab" if self.starts else "wb") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.root,
                env=env,
                start_new_session=True,  # a Ctrl-C in the launcher's terminal reaches only the launcher
                preexec_fn=self._place if self.cpus is not None or self.nice else None,
            )
        self.starts += 1
        self.started_at = time.monotonic()
        self.ready_at = 0.0

    def _place(self) -> None:
        """In the child, before it runs the service: every thread it starts inherits this."""
        if self.cpus is not None:
            os.sched_setaffinity(0, self.cpus)
        if self.nice:
            set_session_nice(os.nice(self.nice))

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def log_tail(self, lines: int = 30) -> str:
        """The last `lines` lines of the JSON log, then of the native output (where a crash's
        traceback and a refusal's message are), each file's lines in order."""
        tails = []
        for path in (self.log_path, self.native_log_path):
            try:
                text = path.read_text(errors="replace")
            except FileNotFoundError:
                continue
            if text.strip():
                tails.append("\n".join(text.splitlines()[-lines:]))
        return "\n".join(tails)

    def wait_ready(self, timeout_s: float, listener: str | None = None) -> str:
        """Block until the service printed its address; return it. `listener`: the address of
        that named second listener of the process instead (the router's `openai_door`)."""
        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        pattern = _LISTENING if listener is None else re.compile(rf"^{listener} listening on (\S+:\d+)$", re.MULTILINE)
        while time.monotonic() < deadline:
            with self.native_log_path.open("rb") as log:
                log.seek(self._log_offset)
                match = pattern.search(log.read().decode(errors="replace"))
            if match and listener is not None:
                return match.group(1)
            if match:
                self.address = match.group(1)
                self.ready_at = time.monotonic()
                return self.address
            if self.process.poll() is not None:
                raise LaunchError(
                    f"{self.name} exited with status {self.process.returncode} before listening:\n{self.log_tail()}"
                )
            time.sleep(0.05)
        raise LaunchError(f"{self.name} did not listen within {timeout_s:.0f} s:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM, wait, then SIGKILL; returns the exit status. Leftovers of its group are killed."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self._end_group()
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL at once (failure tests: an encoder disappearing), and its group's leftovers."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(5)
        self._end_group()

    def _end_group(self) -> None:
        """SIGKILL what is left of the exited service's process group (its id is the service's PID:
        `start_new_session`); nothing when the service still runs or never ran. While a member of
        the group lives its id cannot be given to another process, so once the service's PID is
        free the group holds only what the service left."""
        if self.process is None or self.process.poll() is None:
            return
        if Path(f"/proc/{self.process.pid}").exists():
            return  # the PID was given to another process: the group is gone
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
