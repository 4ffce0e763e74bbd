"""A Mooncake Store client that never raises and never blocks past its deadline.

Mooncake's Python binding reports failures as negative return codes and has no per-call timeout:
against a dead master a call blocks for seconds, against a frozen one a put blocks far longer, and
`setup` retries for over a minute by default. So every call runs on one of a few daemon worker
threads (the binding releases the GIL) and the caller waits only `op_timeout_s`; a circuit breaker
stops calling a store that keeps failing. Every failure becomes a `StoreResult` status, a warning
(rate-limited) and a metric.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from opentelemetry import metrics

from libs.cache.breaker import BreakerState, CircuitBreaker

log = logging.getLogger(__name__)

# Mooncake ErrorCode values (mooncake-store/include/types.h) that the Python binding returns as ints.
NO_AVAILABLE_HANDLE = -200  # no segment has room: the store is full
INVALID_PARAMS = -600  # e.g. a value larger than this client's local buffer, or empty
REPLICA_IS_NOT_READY = -703
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
TRANSFER_FAIL = -800  # the holder of the data is gone
RPC_FAIL = -900  # the master is gone
RPC_TIMEOUT = -901
TENANT_QUOTA_EXCEEDED = -1700
_UNAVAILABLE_CODES = frozenset({TRANSFER_FAIL, RPC_FAIL, RPC_TIMEOUT, -1010, -1011, -1})


class StoreStatus(enum.Enum):
    OK = "ok"
    NOT_FOUND = "not_found"
    FULL = "full"
    TOO_LARGE = "too_large"  # larger than this client's transfer buffer
    UNAVAILABLE = "unavailable"  # master/holder unreachable, timed out, or the breaker is open
    ERROR = "error"


@dataclass(frozen=True)
class StoreResult:
    status: StoreStatus
    data: bytes | None = None
    code: int | None = None  # the Mooncake return code, when there was one
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status is StoreStatus.OK


def classify(code: int) -> StoreStatus:
    """Map a Mooncake return code to a status."""
    if code >= 0:
        return StoreStatus.OK
    if code in (OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY):
        return StoreStatus.NOT_FOUND
    if code in (NO_AVAILABLE_HANDLE, TENANT_QUOTA_EXCEEDED):
        return StoreStatus.FULL
    if code in _UNAVAILABLE_CODES:
        return StoreStatus.UNAVAILABLE
    return StoreStatus.ERROR


@dataclass(frozen=True)
class StoreConfig:
    master_address: str  # "127.0.0.1:port" of mooncake_master
    local_hostname: str = "127.0.0.1"
    protocol: str = "tcp"
    # Registered staging memory of this client; also the largest entry it can put or get.
    local_buffer_size: int = 64 << 20
    op_timeout_s: float = 2.0
    setup_timeout_s: float = 10.0
    failures_to_open: int = 3
    cooldown_s: float = 5.0
    workers: int = 4  # the most calls in flight; a stuck call holds one
    max_pending: int = 32  # calls queued for a worker; beyond that a call is UNAVAILABLE at once


class StoreClient(Protocol):
    """What `EncoderCache` needs from a store; `MooncakeStoreClient` is the real one."""

    def connect(self) -> StoreResult: ...
    def get(self, key: str) -> StoreResult: ...
    async def aget(self, key: str) -> StoreResult: ...
    def put(self, key: str, data: bytes) -> StoreResult: ...
    def exists(self, key: str) -> StoreResult: ...
    async def aexists(self, key: str) -> StoreResult: ...
    def remove(self, key: str) -> StoreResult: ...
    def close(self) -> None: ...


def _mooncake_factory() -> Any:
    from mooncake.store import MooncakeDistributedStore

    return MooncakeDistributedStore()


class _Workers:
    """Daemon threads (a stuck native call must not hold up interpreter exit, as a pool's would),
    with at most `max_pending` calls queued behind the running ones."""

    def __init__(self, count: int, name: str, max_pending: int = 0) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = queue.SimpleQueue()
        self._busy = 0  # running + queued
        self._lock = threading.Lock()
        self.count = count
        self.max_pending = max_pending
        for i in range(count):
            threading.Thread(target=self._loop, name=f"{name}-{i}", daemon=True).start()

    def try_submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any] | None:
        """None when every worker is busy and the queue full (e.g. stuck in calls to a frozen store).
        A caller that stops waiting cancels its future: a queued call then never runs."""
        with self._lock:
            if self._busy >= self.count + self.max_pending:
                return None
            self._busy += 1
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._jobs.put((fn, future))
        return future

    def _loop(self) -> None:
        while True:
            fn, future = self._jobs.get()
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except BaseException as exc:
                        future.set_exception(exc)
            finally:
                with self._lock:
                    self._busy -= 1


class MooncakeStoreClient:
    """A store client (global_segment_size=0: it lends no memory; the holder process does)."""

    def __init__(
        self,
        config: StoreConfig,
        *,
        factory: Callable[[], Any] = _mooncake_factory,
        meter: metrics.Meter | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._factory = factory
        self._client: Any = None
        self._setup_lock = threading.Lock()
        self._workers = _Workers(config.workers, "mooncake-store", config.max_pending)
        self.breaker = CircuitBreaker(config.failures_to_open, config.cooldown_s, clock)
        self._clock = clock
        self._last_warned: dict[tuple[str, StoreStatus], float] = {}
        self._closed = False
        meter = meter or metrics.get_meter("epd")
        self._ops = meter.create_counter("epd.cache.store.ops", description="Mooncake Store calls by op and status")
        # Bounds `setup` against a dead master to one attempt instead of 20.
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")

    # -- public API: each returns a StoreResult, never raises ---------------------------------------

    def connect(self) -> StoreResult:
        """Set up the client now (optional: the first call does it). Waits at most `setup_timeout_s`."""
        return self._call("connect", lambda c: StoreResult(StoreStatus.OK), self.config.setup_timeout_s)

    def get(self, key: str) -> StoreResult:
        return self._call("get", lambda c: self._get(c, key))

    async def aget(self, key: str) -> StoreResult:
        return await self._acall("get", lambda c: self._get(c, key))

    def put(self, key: str, data: bytes) -> StoreResult:
        if len(data) > self.config.local_buffer_size:
            return self._finish("put", StoreResult(StoreStatus.TOO_LARGE, detail=f"{len(data)} bytes"))
        return self._call("put", lambda c: self._code_result(c.put(key, data)))

    def exists(self, key: str) -> StoreResult:
        return self._call("exists", lambda c: self._exists(c, key))

    async def aexists(self, key: str) -> StoreResult:
        return await self._acall("exists", lambda c: self._exists(c, key))

    def remove(self, key: str) -> StoreResult:
        # force: a get just granted this key a lease, and a poisoned entry must go now.
        return self._call("remove", lambda c: self._code_result(c.remove(key, True)))

    def close(self) -> None:
        self._closed = True
        client, self._client = self._client, None
        if client is not None:
            self._workers.try_submit(client.close)  # off-thread: close can block on a dead master

    # -- internals -------------------------------------------------------------------------------------

    @staticmethod
    def _code_result(code: int) -> StoreResult:
        return StoreResult(classify(code), code=code)

    def _exists(self, client: Any, key: str) -> StoreResult:
        code = client.is_exist(key)  # 1 present, 0 absent, negative on failure
        if code < 0:
            return self._code_result(code)
        return StoreResult(StoreStatus.OK if code == 1 else StoreStatus.NOT_FOUND, code=code)

    def _get(self, client: Any, key: str) -> StoreResult:
        # `get` returns b"" for a missing key and for every failure alike, so ask the size first.
        size = client.get_size(key)
        if size < 0:
            return self._code_result(size)
        if size > self.config.local_buffer_size:
            return StoreResult(StoreStatus.TOO_LARGE, detail=f"{size} bytes")
        data = client.get(key)
        if len(data) == size:
            return StoreResult(StoreStatus.OK, data=data)
        again = client.get_size(key)
        if again == OBJECT_NOT_FOUND:  # evicted or removed between the two calls
            return StoreResult(StoreStatus.NOT_FOUND, code=again)
        return StoreResult(StoreStatus.UNAVAILABLE, code=TRANSFER_FAIL, detail=f"read {len(data)} of {size} bytes")

    def _connected(self) -> Any:
        client = self._client
        if client is not None:
            return client
        if not self._setup_lock.acquire(blocking=False):
            raise _NotConnected("setup in progress")
        try:
            if self._client is None:
                c = self._factory()
                cfg = self.config
                code = c.setup(
                    cfg.local_hostname, "P2PHANDSHAKE", 0, cfg.local_buffer_size, cfg.protocol, "", cfg.master_address
                )
                if code != 0:
                    raise _NotConnected(f"setup returned {code}")
                if self._closed:
                    c.close()
                    raise _NotConnected("closed")
                self._client = c
            return self._client
        finally:
            self._setup_lock.release()

    def _job(self, fn: Callable[[Any], StoreResult]) -> Callable[[], StoreResult]:
        def run() -> StoreResult:
            try:
                return fn(self._connected())
            except _NotConnected as exc:
                return StoreResult(StoreStatus.UNAVAILABLE, detail=str(exc))
            except Exception as exc:  # a binding error must not escape to the caller
                return StoreResult(StoreStatus.ERROR, detail=repr(exc))

        return run

    def _submit(self, fn: Callable[[Any], StoreResult]) -> concurrent.futures.Future[Any] | StoreResult:
        if self._closed:
            return StoreResult(StoreStatus.UNAVAILABLE, detail="closed")
        if not self.breaker.allow():
            return StoreResult(StoreStatus.UNAVAILABLE, detail="circuit open")
        future = self._workers.try_submit(self._job(fn))
        if future is None:
            self.breaker.record_failure()
            return StoreResult(StoreStatus.UNAVAILABLE, detail="all store workers busy")
        return future

    def _call(self, op: str, fn: Callable[[Any], StoreResult], timeout: float | None = None) -> StoreResult:
        submitted = self._submit(fn)
        if isinstance(submitted, StoreResult):
            return self._finish(op, submitted, counted=False)
        try:
            result: StoreResult = submitted.result(timeout=timeout or self.config.op_timeout_s)
        except concurrent.futures.TimeoutError:
            submitted.cancel()  # still queued: never runs
            result = StoreResult(StoreStatus.UNAVAILABLE, detail=f"{op} timed out")
        return self._finish(op, result)

    async def _acall(self, op: str, fn: Callable[[Any], StoreResult]) -> StoreResult:
        submitted = self._submit(fn)
        if isinstance(submitted, StoreResult):
            return self._finish(op, submitted, counted=False)
        try:
            result: StoreResult = await asyncio.wait_for(asyncio.wrap_future(submitted), self.config.op_timeout_s)
        except TimeoutError:
            result = StoreResult(StoreStatus.UNAVAILABLE, detail=f"{op} timed out")
        return self._finish(op, result)

    def _finish(self, op: str, result: StoreResult, *, counted: bool = True) -> StoreResult:
        """Feed the breaker, count the call and warn (at most every 10 s per op and status)."""
        if counted:
            if result.status is StoreStatus.UNAVAILABLE:
                if self.breaker.record_failure():
                    log.warning("mooncake store unavailable (%s: %s); circuit open", op, result.detail or result.code)
            elif self.breaker.record_success() is not BreakerState.CLOSED:
                log.warning("mooncake store reachable again; circuit closed")
        self._ops.add(1, {"epd.cache.op": op, "epd.cache.status": result.status.value})
        if result.status not in (StoreStatus.OK, StoreStatus.NOT_FOUND):
            now = self._clock()
            if now - self._last_warned.get((op, result.status), -1e9) >= 10.0:
                self._last_warned[(op, result.status)] = now
                log.warning("mooncake store %s: %s (%s)", op, result.status.value, result.detail or result.code)
        return result


class _NotConnected(Exception):
    pass
