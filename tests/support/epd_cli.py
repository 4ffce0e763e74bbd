"""The installed `epd` command line as a test runs it: a subprocess of the venv's `epd` script on
the checkout under test, stopped by its PID; the lines a long-running one (`epd up`) prints,
waited for by content; and the whitespace-aligned tables it prints."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

from libs.launch.process import ROOT

EPD = str(Path(sys.executable).parent / "epd")


def cli_env() -> dict[str, str]:
    # The checkout under test, whatever the venv's editable install points at.
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}


def run_epd(args: list[str], cwd: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """Run `epd args` to completion; on timeout stop it by its PID (SIGINT, then SIGKILL)."""
    process = subprocess.Popen(
        [EPD, *args], cwd=cwd, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        out, err = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGINT)  # the demo and `up` stop their services on the way out
        try:
            out, err = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
        raise AssertionError(f"epd {' '.join(args)} ran past {timeout_s} s:\n{out}\n{err}") from None
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


class Lines:
    """The merged output of a running command, line by line, waited for by content."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.seen: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        assert process.stdout is not None
        threading.Thread(target=self._read, args=(process.stdout,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self._queue.put(line)
        self._queue.put(None)

    def until(self, pattern: str, timeout_s: float) -> re.Match[str]:
        """The first line from now on matching `pattern`, within `timeout_s`; AssertionError at the
        end of the output."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"no line matching {pattern!r} within {timeout_s} s:\n{''.join(self.seen)}"
                ) from None
            if line is None:
                raise AssertionError(f"output ended before {pattern!r}:\n{''.join(self.seen)}")
            self.seen.append(line)
            if match := re.search(pattern, line):
                return match

    def rest(self, timeout_s: float) -> str:
        """Everything printed, once the output ends (the process exits)."""
        while True:
            line = self._queue.get(timeout=timeout_s)
            if line is None:
                return "".join(self.seen)
            self.seen.append(line)


def parse_table(text: str, header_start: str) -> tuple[list[str], dict[str, list[str]]]:
    """Columns and rows (by first cell) of the whitespace-aligned table whose header starts so."""
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows: dict[str, list[str]] = {}
    for line in lines[at + 1 :]:
        if not line.strip():
            break
        cells = line.split()
        rows[cells[0]] = cells[1:]
    return lines[at].split()[1:], rows
