"""A stopped or killed service takes what it started with it: the launcher ends the leftovers of
its process group (a vLLM engine core outlives a SIGKILLed service, holding memory and a core)."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from libs.launch.process import ServiceProcess, session_nice

pytestmark = pytest.mark.integration


def _started(tmp_path: Path) -> tuple[ServiceProcess, int]:
    service = ServiceProcess("worker", "tests.support.parent", [], log_path=tmp_path / "worker.log")
    service.start()
    service.wait_ready(30)
    match = re.search(r"^child (\d+)$", service.native_log_path.read_text(), re.MULTILINE)
    assert match, service.log_tail()
    return service, int(match.group(1))


def _gone(pid: int, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # reaped by nobody yet (its parent died: init reaps it): a zombie is gone too
            if Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z"):
                return True
        except (FileNotFoundError, IndexError):
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize("end", ["kill", "stop"])
def test_the_child_a_service_left_is_ended_with_it(tmp_path: Path, end: str) -> None:
    service, child = _started(tmp_path)
    try:
        os.kill(child, 0)  # running beside its service
        if end == "kill":
            service.kill()
        else:
            assert service.stop(timeout_s=5) is not None
        assert not service.alive()
        assert _gone(child), f"the service's child {child} outlived it"
    finally:
        if not _gone(child, 0.1):
            os.kill(child, 9)


def test_a_placed_service_and_what_it_starts_run_on_its_cpus_at_its_priority(tmp_path: Path) -> None:
    cpu = min(os.sched_getaffinity(0))
    service = ServiceProcess(
        "worker", "tests.support.parent", [], log_path=tmp_path / "worker.log", cpus=frozenset({cpu}), nice=5
    )
    service.start()
    try:
        service.wait_ready(30)
        match = re.search(r"^child (\d+)$", service.native_log_path.read_text(), re.MULTILINE)
        assert match, service.log_tail()
        nice = min(19, os.getpriority(os.PRIO_PROCESS, 0) + 5)
        for pid in (service.pid, int(match.group(1))):
            assert os.sched_getaffinity(pid) == {cpu}
            assert os.getpriority(os.PRIO_PROCESS, pid) == nice
            # Its session too, or the kernel's autogroups would share the CPU with it as at nice 0.
            if session_nice(os.getpid()) is not None:
                assert session_nice(pid) == nice
    finally:
        service.kill()
