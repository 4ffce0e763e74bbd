"""A circuit breaker: after repeated failures, stop calling a dead dependency for a while."""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable


class BreakerState(enum.Enum):
    CLOSED = "closed"  # calls go through
    OPEN = "open"  # calls are refused until the cooldown passes
    HALF_OPEN = "half_open"  # one probe call is let through


class CircuitBreaker:
    """Opens after `failures_to_open` consecutive failures; after `cooldown_s` one probe is allowed.

    A successful probe closes it; a failed one re-opens it for another cooldown. This turns a dead
    store from "every request waits for a timeout" into "one request per cooldown does".
    """

    def __init__(
        self, failures_to_open: int = 3, cooldown_s: float = 5.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.failures_to_open = failures_to_open
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._probe_out = False

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._state

    def allow(self) -> bool:
        """Whether a call may go ahead now (in half-open state, only the first caller may)."""
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return True
            if self._state is BreakerState.OPEN and self._clock() - self._opened_at >= self.cooldown_s:
                self._state = BreakerState.HALF_OPEN
                self._probe_out = False
            if self._state is BreakerState.HALF_OPEN and not self._probe_out:
                self._probe_out = True
                return True
            return False

    def record_success(self) -> BreakerState:
        """Returns the state before the call was recorded (to log transitions)."""
        with self._lock:
            before = self._state
            self._state = BreakerState.CLOSED
            self._failures = 0
            self._probe_out = False
            return before

    def record_failure(self) -> bool:
        """Returns True when this failure opened the breaker."""
        with self._lock:
            self._failures += 1
            if self._state is BreakerState.HALF_OPEN or (
                self._state is BreakerState.CLOSED and self._failures >= self.failures_to_open
            ):
                self._state = BreakerState.OPEN
                self._opened_at = self._clock()
                self._probe_out = False
                return True
            return False
