"""Start engine stages as separate processes and talk to them with `wire` frames."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from tests.support import wire

REPO = Path(__file__).resolve().parents[2]


class StageProcess:
    def __init__(self, role: str, model_paths: list[Path]) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.stage_worker", role, *map(str, model_paths)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=REPO,
            env=env,
        )
        self.ready: dict[str, Any] = {}

    def wait_ready(self) -> None:
        assert self.proc.stdout is not None
        self.ready, _ = wire.unpack(wire.read_frame(self.proc.stdout))
        assert self.ready["ready"]

    def call(
        self, header: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        wire.write_frame(self.proc.stdin, wire.pack(header, tensors))
        return wire.unpack(wire.read_frame(self.proc.stdout))

    def request_exit(self) -> None:
        try:
            if self.proc.poll() is None and self.proc.stdin is not None and not self.proc.stdin.closed:
                wire.write_frame(self.proc.stdin, wire.pack({"op": "exit"}))
                self.proc.stdin.close()
        except OSError:
            pass  # already gone; close() reaps it

    def close(self) -> None:
        """Ask the process to exit; kill it (by its own PID) if it does not."""
        self.request_exit()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def close_all(stages: list[StageProcess]) -> None:
    """Let every process tear down at once (interpreter exit with torch takes ~1.5 s each)."""
    for stage in stages:
        stage.request_exit()
    for stage in stages:
        stage.close()
