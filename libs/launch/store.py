"""Run a real Mooncake Store on loopback: `mooncake_master` plus one `mooncake_client` holder.

The holder lends `segment_size` bytes to the store (encoders run clients that lend 0). Both run as
child processes on free 127.0.0.1 ports; readiness is read from the master's HTTP admin port
(`/health`, then `master_total_capacity_bytes` once the holder's segment is mounted). Stopping is by
PID, SIGTERM then SIGKILL. Used by the launcher (libs/launch/stack.py) and by the tests.

Their output (glog text, not JSON) goes to `<binary>.native.log` in the log directory: the suffix
says what a service's native output file says (libs/launch/process.py), so every other `*.log` of a
run holds JSON lines only.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from libs.launch.process import NATIVE_SUFFIX, free_port

HOST = "127.0.0.1"
log = logging.getLogger(__name__)


class StoreStartError(RuntimeError):
    pass


def mooncake_binary(name: str) -> Path:
    """Path of a binary shipped inside the `mooncake` wheel (`mooncake_master`, `mooncake_client`)."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or spec.origin is None:
        raise StoreStartError("the mooncake package is not installed (mooncake-transfer-engine-non-cuda)")
    path = Path(spec.origin).parent / name
    if not path.exists():
        raise StoreStartError(f"{path} not found")
    if not os.access(path, os.X_OK):
        path.chmod(path.stat().st_mode | 0o111)
    return path


def stop_process(proc: subprocess.Popen[bytes] | None, timeout: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after `timeout`; only the given child, by its PID."""
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout)


def _http_get(url: str, timeout: float = 1.0) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            body: bytes = resp.read()
            return body.decode()
    except OSError:
        return None


def _proc_state(pid: int) -> str:
    """Kernel state and wait channel of each thread: the clue when a child hangs silently."""
    try:
        tasks = sorted(os.listdir(f"/proc/{pid}/task"))
        states = [
            f"{t}:{Path(f'/proc/{pid}/task/{t}/stat').read_text().split()[2]}"
            f"/{Path(f'/proc/{pid}/task/{t}/wchan').read_text() or '-'}"
            for t in tasks[:8]
        ]
        return f"pid {pid} threads {len(tasks)} " + " ".join(states)
    except OSError as exc:
        return f"pid {pid}: {exc}"


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@dataclass
class StoreProcesses:
    """A running master and holder. `master_address` is what store clients connect to."""

    log_dir: Path
    segment_size: int
    master_port: int = 0
    admin_port: int = 0
    holder_port: int = 0
    master: subprocess.Popen[bytes] | None = None
    holder: subprocess.Popen[bytes] | None = None
    _logs: list[IO[bytes]] = field(default_factory=list)

    @property
    def master_address(self) -> str:
        return f"{HOST}:{self.master_port}"

    def metrics(self) -> dict[str, float]:
        """The master's Prometheus gauges and counters (unlabelled ones), {} if it does not answer."""
        text = _http_get(f"http://{HOST}:{self.admin_port}/metrics") or ""
        found = re.findall(r"^([a-z_]+) ([0-9.e+-]+)$", text, re.MULTILINE)
        return {name: float(value) for name, value in found}

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        out = open(self._log(name), "wb")  # noqa: SIM115 - lives as long as the process
        self._logs.append(out)
        return subprocess.Popen(
            [str(mooncake_binary(name)), *args, "--logtostderr"],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C to the parent is ours to forward, not the terminal's
        )

    def _log(self, name: str) -> Path:
        return self.log_dir / f"{name}{NATIVE_SUFFIX}"

    def start_master(self, timeout: float = 15.0, *, same_ports: bool = False) -> None:
        """Start the master; `same_ports` restarts it where clients already look (after a crash)."""
        if not same_ports or not self.master_port:
            self.master_port, self.admin_port = free_port(), free_port()
        self.master = self._spawn(
            "mooncake_master",
            [
                f"--rpc_address={HOST}",
                f"--rpc_port={self.master_port}",
                f"--metrics_host={HOST}",
                f"--metrics_port={self.admin_port}",
                "--rpc_thread_num=2",
            ],
        )
        self._wait(timeout, "mooncake_master", self.master, lambda: '"ok"' in (_http_get(self._admin("health")) or ""))

    def start_holder(self, timeout: float = 15.0) -> None:
        before = self.metrics().get("master_total_capacity_bytes", 0.0)
        self.holder_port = free_port()  # a new one: the old holder's port may linger in TIME_WAIT
        self.holder = self._spawn(
            "mooncake_client",
            [
                f"--host={HOST}",
                f"--port={self.holder_port}",
                f"--master_server_address={self.master_address}",
                "--metadata_server=P2PHANDSHAKE",
                "--protocol=tcp",
                f"--global_segment_size={self.segment_size}",
                "--local_buffer_size=16MB",
                "--threads=1",
            ],
        )
        self._wait(
            timeout,
            "mooncake_client",
            self.holder,
            lambda: self.metrics().get("master_total_capacity_bytes", 0.0) >= before + self.segment_size,
        )

    def _admin(self, path: str) -> str:
        return f"http://{HOST}:{self.admin_port}/{path}"

    def _wait(self, timeout: float, name: str, proc: subprocess.Popen[bytes], ready: Callable[[], bool]) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise StoreStartError(f"{name} exited with {proc.returncode}:\n{_tail(self._log(name))}")
            if ready():
                return
            time.sleep(0.05)
        state = _proc_state(proc.pid)
        raise StoreStartError(f"{name} not ready after {timeout} s ({state}):\n{_tail(self._log(name))}")

    def stop_holder(self) -> None:
        stop_process(self.holder)

    def stop_master(self) -> None:
        stop_process(self.master)

    def stop(self) -> None:
        self.stop_holder()
        self.stop_master()
        for out in self._logs:
            out.close()
        self._logs.clear()


def start_store(
    log_dir: Path, *, segment_size: int = 256 << 20, timeout: float = 10.0, attempts: int = 3
) -> StoreProcesses:
    """Start a master and one holder lending `segment_size` bytes; stops both if either fails.

    A start that does not come up within `timeout` is stopped and retried on fresh ports: on a
    loaded machine a just-freed port can be taken again, and a child occasionally stalls silently
    before its first log line.
    """
    for attempt in range(1, attempts + 1):
        attempt_dir = log_dir if attempt == 1 else log_dir / f"retry{attempt}"
        attempt_dir.mkdir(parents=True, exist_ok=True)
        procs = StoreProcesses(log_dir=attempt_dir, segment_size=segment_size)
        try:
            procs.start_master(timeout)
            procs.start_holder(timeout)
            return procs
        except StoreStartError as exc:
            procs.stop()
            if attempt == attempts:
                raise
            log.warning("mooncake store start attempt %d failed, retrying: %s", attempt, exc)
        except BaseException:
            procs.stop()
            raise
    raise AssertionError("unreachable")
