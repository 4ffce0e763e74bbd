"""vLLM's engine processes waiting for each other (libs/backends/vllm/engine_polling.py): the
service's window caps vLLM's polling, and a sleeping reader still looks at its queue every
WAKE_MS (vLLM's ping can be dropped). vLLM's own SpinCondition, no engine."""

from __future__ import annotations

from typing import Any

import pytest

from libs.backends.vllm import engine_polling

pytestmark = pytest.mark.vllm  # imports vLLM (no engine starts)


@pytest.fixture
def spin_condition(monkeypatch: pytest.MonkeyPatch) -> Any:
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    calls: list[tuple[float, int | None]] = []

    def wait(self: Any, timeout_ms: int | None = None) -> None:
        calls.append((self.busy_loop_s, timeout_ms))

    monkeypatch.setattr(SpinCondition, "wait", wait)
    return SpinCondition, calls


def _reader(cls: Any) -> Any:
    reader = cls.__new__(cls)  # no sockets: the wrapper only reads and caps the window
    reader.busy_loop_s = 1.0
    return reader


def test_without_the_setting_vllms_own_wait_stays(spin_condition: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    cls, _ = spin_condition
    monkeypatch.delenv(engine_polling.ENV, raising=False)
    original = cls.wait
    engine_polling.install()
    monkeypatch.setenv(engine_polling.ENV, "-1")
    engine_polling.install()
    assert cls.wait is original


def test_the_window_is_capped_and_a_sleeping_reader_wakes_every_wake_ms(
    spin_condition: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    cls, calls = spin_condition
    monkeypatch.setenv(engine_polling.ENV, "0")
    engine_polling.install()
    engine_polling.install()  # once per process
    reader = _reader(cls)
    cls.wait(reader)  # vLLM's "wait for the ping" (no timeout): bounded
    cls.wait(reader, 60_000)  # vLLM's read timeout: bounded too
    cls.wait(reader, 0)
    assert calls == [(0.0, engine_polling.WAKE_MS), (0.0, engine_polling.WAKE_MS), (0.0, 0)]
    assert cls.wait.__wrapped__.__name__ == "wait"
