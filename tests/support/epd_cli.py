"""The installed `epd` command line as a test runs it: a subprocess of the venv's `epd` script on
the checkout under test, stopped by its PID; and the whitespace-aligned tables it prints."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

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
