from __future__ import annotations

import pytest

from libs.cache.breaker import BreakerState, CircuitBreaker

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_opens_after_consecutive_failures_and_probes_after_cooldown() -> None:
    clock = Clock()
    breaker = CircuitBreaker(failures_to_open=3, cooldown_s=5.0, clock=clock)
    assert not breaker.record_failure() and not breaker.record_failure()
    breaker.record_success()  # resets the count
    assert not breaker.record_failure() and not breaker.record_failure()
    assert breaker.record_failure()
    assert breaker.state is BreakerState.OPEN and not breaker.allow()
    clock.now = 5.0
    assert breaker.allow()  # the one probe
    assert not breaker.allow()  # everyone else still waits
    assert breaker.state.value == "half_open"
    assert breaker.record_success() is BreakerState.HALF_OPEN
    assert breaker.state.value == "closed" and breaker.allow()


def test_failed_probe_reopens_for_another_cooldown() -> None:
    clock = Clock()
    breaker = CircuitBreaker(failures_to_open=1, cooldown_s=2.0, clock=clock)
    breaker.record_failure()
    clock.now = 2.0
    assert breaker.allow()
    assert breaker.record_failure()
    clock.now = 3.0
    assert not breaker.allow()
    clock.now = 4.0
    assert breaker.allow()
