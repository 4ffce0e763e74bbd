"""The supervisor's restart policy, on real short-lived processes (no model): a process that keeps
dying is restarted after delays that double, and one that ran stably restarts without back-off.
The full behaviour under load is the chaos soak (tests/services/test_chaos_soak.py)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from libs.launch.process import ServiceProcess
from libs.launch.stack import Stack, StackSpec
from libs.launch.supervisor import Supervisor

pytestmark = pytest.mark.integration


def _stack(tmp_path: Path, life_s: float) -> tuple[Stack, ServiceProcess]:
    stack = Stack(StackSpec(run_dir=tmp_path, fixed_ports=True))
    process = ServiceProcess("worker", "tests.support.crasher", [str(life_s)], log_path=tmp_path / "worker.log")
    stack.processes["worker"] = process
    process.start()
    process.wait_ready(30)
    return stack, process


def _delays(events: list[tuple[float, str, str]]) -> list[float]:
    return [float(m.group(1)) for _, _, e in events if (m := re.match(r"died; restart in ([0-9.]+) s", e))]


def test_a_process_that_keeps_dying_backs_off(tmp_path: Path) -> None:
    stack, process = _stack(tmp_path, life_s=0.05)
    supervisor = Supervisor(stack, first_delay_s=0.1, max_delay_s=0.4, stable_s=60, poll_s=0.02).start()
    try:
        deadline = time.monotonic() + 30
        while len(_delays(supervisor.log.events)) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        supervisor.stop()
        process.stop()
    assert _delays(supervisor.log.events)[:5] == [0.1, 0.2, 0.4, 0.4, 0.4]
    assert process.starts >= 5


def test_a_process_that_ran_stably_restarts_without_back_off(tmp_path: Path) -> None:
    stack, process = _stack(tmp_path, life_s=0.6)
    supervisor = Supervisor(stack, first_delay_s=0.1, max_delay_s=5, stable_s=0.3, poll_s=0.02).start()
    try:
        deadline = time.monotonic() + 30
        while supervisor.log.restarts("worker") < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        supervisor.stop()
        process.stop()
    assert _delays(supervisor.log.events)[:3] == [0.1, 0.1, 0.1]


def test_supervision_needs_fixed_ports(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="fixed_ports"):
        Supervisor(Stack(StackSpec(run_dir=tmp_path)))
