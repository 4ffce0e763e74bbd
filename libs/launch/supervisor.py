"""Keep a stack's processes alive: a role that dies is started again, with back-off.

`Supervisor` watches every service process of a `Stack` (started with `fixed_ports`, so a
replacement listens where peers already look) and the Mooncake Store's master and holder. A dead
process is restarted after a delay that doubles with each death in a row (0.5 s up to 30 s) and
resets once an incarnation has stayed up for `stable_s`. Roles restart in parallel (each on its own
thread): a slow start of one never delays another's. A master restart loses the store's
contents by design (Mooncake keeps no state across restarts); its holder is restarted with it so
the store has memory again, and encoders treat the empty store as misses meanwhile.

Used by `epd up` (unless `--no-supervise`) and by the chaos soak (tests/soak).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from libs.launch.process import LaunchError, ServiceProcess
from libs.launch.stack import Stack

STORE_MASTER = "store-master"
STORE_HOLDER = "store-holder"


@dataclass
class _Backoff:
    delay_s: float
    deaths: int = 0
    due: float | None = None  # monotonic instant of the pending restart


@dataclass
class RestartLog:
    """What the supervisor did: (monotonic time, role, event) in order."""

    events: list[tuple[float, str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, role: str, event: str) -> None:
        with self.lock:
            self.events.append((time.monotonic(), role, event))

    def restarts(self, role: str) -> int:
        with self.lock:
            return sum(1 for _, r, e in self.events if r == role and e == "ready")


class Supervisor:
    def __init__(
        self,
        stack: Stack,
        *,
        first_delay_s: float = 0.5,
        max_delay_s: float = 30.0,
        stable_s: float = 30.0,
        poll_s: float = 0.2,
        on_event: Callable[[str, str], None] = lambda role, event: None,
    ) -> None:
        if not stack.spec.fixed_ports:
            raise ValueError("a supervised stack needs fixed_ports: a restarted service must keep its address")
        self._stack = stack
        self._first, self._max, self._stable, self._poll = first_delay_s, max_delay_s, stable_s, poll_s
        self._on_event = on_event
        self._backoff: dict[str, _Backoff] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._restarting: set[str] = set()
        self._lock = threading.Lock()
        self.log = RestartLog()

    def start(self) -> Supervisor:
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (before the stack goes down, so stopped processes stay stopped)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)

    def settled(self) -> bool:
        """Every role up and serving: none dead, no restart under way."""
        with self._lock:
            busy = bool(self._restarting)
        return not busy and not self._dead()

    def wait_settled(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.settled():
                return True
            time.sleep(self._poll)
        return False

    def _event(self, role: str, event: str) -> None:
        self.log.add(role, event)
        self._on_event(role, event)

    def _dead(self) -> dict[str, Callable[[], None]]:
        """Every dead role, with how to bring it back."""
        dead: dict[str, Callable[[], None]] = {}
        for name, process in self._stack.processes.items():
            if not process.alive():
                dead[name] = functools.partial(self._restart_service, process)
        store = self._stack.store
        if store is not None:
            if store.master is not None and store.master.poll() is not None:
                dead[STORE_MASTER] = self._restart_store
            elif store.holder is not None and store.holder.poll() is not None:
                dead[STORE_HOLDER] = self._restart_holder
        return dead

    def _restart_service(self, process: ServiceProcess) -> None:
        process.start()
        process.wait_ready(self._stack.spec.ready_timeout_s)

    def _restart_store(self) -> None:
        store = self._stack.store
        assert store is not None
        store.stop_holder()  # its segment was mounted on the dead master
        store.start_master(same_ports=True)
        store.start_holder()

    def _restart_holder(self) -> None:
        store = self._stack.store
        assert store is not None
        store.start_holder()

    def _uptime(self, role: str) -> float:
        process = self._stack.processes.get(role)
        return time.monotonic() - process.started_at if process is not None else self._stable

    def _restart(self, role: str, restart: Callable[[], None]) -> None:
        try:
            restart()
            self._event(role, "ready")
        except (LaunchError, OSError, RuntimeError) as exc:
            self._event(role, f"restart failed: {str(exc).splitlines()[0]}")
        finally:
            with self._lock:
                self._restarting.discard(role)

    def _run(self) -> None:
        while not self._stop.wait(self._poll):
            for role, restart in self._dead().items():
                with self._lock:
                    # A master restart brings its holder back too.
                    if role in self._restarting or (role == STORE_HOLDER and STORE_MASTER in self._restarting):
                        continue
                state = self._backoff.setdefault(role, _Backoff(self._first))
                now = time.monotonic()
                if state.due is None:
                    if self._uptime(role) >= self._stable:
                        state.delay_s = self._first  # it had been healthy: no back-off carried over
                    state.deaths += 1
                    state.due = now + state.delay_s
                    self._event(role, f"died; restart in {state.delay_s:.1f} s")
                    state.delay_s = min(self._max, state.delay_s * 2)
                if now < state.due or self._stop.is_set():
                    continue
                state.due = None
                with self._lock:
                    self._restarting.add(role)
                threading.Thread(
                    target=self._restart, args=(role, restart), name=f"restart-{role}", daemon=True
                ).start()
