"""A launched service's logs (libs/launch/process.py with libs/telemetry/logging.py): `<name>.log`
holds JSON lines only, every one of them, however the process's other writers write (a native
library on fd 2 and fd 1, the listening line on stdout); what they wrote is kept, in
`<name>.native.log`; a Python warning and a crash's traceback are JSON lines too; the launcher
still finds the listening line, and a failure's tail shows both files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from libs.launch.process import ServiceProcess

pytestmark = pytest.mark.integration


def test_json_lines_in_the_log_and_native_output_beside_it(tmp_path: Path) -> None:
    service = ServiceProcess("noisy", "tests.support.noisy_service", [], log_path=tmp_path / "noisy.log")
    service.start()
    assert service.wait_ready(60) == "127.0.0.1:1"
    assert service.process is not None and service.process.wait(60) == 1  # the uncaught exception

    lines = service.log_path.read_text().splitlines()
    records = [json.loads(line) for line in lines]  # every line: a JSON object
    events = {r["event"]: r for r in records}
    assert events["starting"]["items"] == 2 and events["starting"]["service"] == "noisy"
    assert events["peer 127.0.0.1:1 gone"]["logger"] == "grpc.some.module"
    assert any("a library's deprecation" in r["event"] for r in records if r.get("logger") == "py.warnings")
    crash = events["uncaught exception"]
    assert crash["level"] == "critical" and "RuntimeError: the service failed" in crash["exception"]

    native = service.native_log_path.read_text()
    assert service.native_log_path.name == "noisy.native.log"
    assert "WARNING: Logging before InitGoogleLogging()" in native and "client_metric.cpp:102]" in native
    assert "ucx  native line on stdout" in native and "noisy listening on 127.0.0.1:1" in native
    assert "RuntimeError: the service failed" in native  # as Python prints it, too
    assert not [line for line in native.splitlines() if line.startswith('{"')]  # no JSON line strayed there

    tail = service.log_tail()
    assert '"uncaught exception"' in tail and "Traceback (most recent call last)" in tail


def test_a_restart_appends_to_both_files_and_waits_for_its_own_listening_line(tmp_path: Path) -> None:
    service = ServiceProcess("noisy", "tests.support.noisy_service", [], log_path=tmp_path / "noisy.log")
    for _ in range(2):
        service.start()
        service.wait_ready(60)
        assert service.process is not None and service.process.wait(60) == 1
    starts = [json.loads(line) for line in service.log_path.read_text().splitlines()]
    assert sum(r["event"] == "starting" for r in starts) == 2
    assert service.native_log_path.read_text().count("noisy listening on") == 2
