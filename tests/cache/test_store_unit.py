"""MooncakeStoreClient against a fake binding: codes, deadlines, breaker. No processes."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from libs.cache.breaker import BreakerState
from libs.cache.store import (
    NO_AVAILABLE_HANDLE,
    RPC_FAIL,
    TRANSFER_FAIL,
    MooncakeStoreClient,
    StoreConfig,
    StoreStatus,
    classify,
)
from tests.support.cache import FakeMooncake, Metrics

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def client(fake: FakeMooncake, metrics: Metrics | None = None, **overrides: float) -> MooncakeStoreClient:
    config = StoreConfig("127.0.0.1:1", op_timeout_s=0.3, failures_to_open=2, cooldown_s=0.5, workers=2)
    config = dataclasses.replace(config, **overrides)  # type: ignore[arg-type]
    return MooncakeStoreClient(config, factory=lambda: fake, meter=(metrics or Metrics()).meter)


def test_codes_map_to_statuses() -> None:
    assert classify(0) is StoreStatus.OK
    assert classify(-704) is StoreStatus.NOT_FOUND
    assert classify(NO_AVAILABLE_HANDLE) is StoreStatus.FULL
    assert classify(RPC_FAIL) is StoreStatus.UNAVAILABLE
    assert classify(TRANSFER_FAIL) is StoreStatus.UNAVAILABLE
    assert classify(-12345) is StoreStatus.ERROR


def test_put_get_exists_remove_and_metrics() -> None:
    metrics = Metrics()
    fake = FakeMooncake()
    store = client(fake, metrics)
    assert store.get("k").status is StoreStatus.NOT_FOUND
    assert store.put("k", b"abc").ok
    assert store.get("k").data == b"abc"
    assert store.exists("k").ok and store.exists("nope").status is StoreStatus.NOT_FOUND
    assert store.remove("k").ok and store.get("k").status is StoreStatus.NOT_FOUND
    assert asyncio.run(store.aget("nope")).status is StoreStatus.NOT_FOUND
    assert fake.calls.count("setup") == 1
    counts = metrics.counters()
    assert counts[("epd.cache.store.ops", "get,not_found")] == 3
    assert counts[("epd.cache.store.ops", "put,ok")] == 1


def test_short_read_is_unavailable_not_a_hit() -> None:
    fake = FakeMooncake()
    store = client(fake)
    store.put("k", b"abc")
    fake.get = lambda key: b""  # type: ignore[method-assign]  # what the binding returns on TRANSFER_FAIL
    result = store.get("k")
    assert result.status is StoreStatus.UNAVAILABLE and result.data is None


def test_entries_larger_than_the_transfer_buffer_are_refused_up_front() -> None:
    fake = FakeMooncake()
    store = client(fake, local_buffer_size=10)
    assert store.put("k", b"x" * 11).status is StoreStatus.TOO_LARGE
    assert "put" not in fake.calls
    fake.objects["big"] = b"x" * 11
    assert store.get("big").status is StoreStatus.TOO_LARGE


def test_binding_exceptions_and_failed_setup_never_escape() -> None:
    fake = FakeMooncake()

    def boom(name: str) -> None:
        if name == "put":
            raise RuntimeError("binding bug")

    fake.hook = boom
    assert client(fake).put("k", b"v").status is StoreStatus.ERROR
    down = client(FakeMooncake(setup_code=-1))
    assert down.get("k").status is StoreStatus.UNAVAILABLE


def test_a_frozen_store_costs_one_deadline_then_the_breaker_answers_at_once() -> None:
    release = threading.Event()
    fake = FakeMooncake()
    store = client(fake)
    store.put("k", b"v")
    reached: list[str] = []

    def frozen(name: str) -> None:  # every call hangs, as against a SIGSTOPped master
        reached.append(name)
        release.wait(120)  # past the test's own limit: only our deadline can answer these calls

    fake.hook = frozen
    assert store.get("k").status is StoreStatus.UNAVAILABLE  # ended by our 0.3 s deadline
    assert store.get("k").status is StoreStatus.UNAVAILABLE
    assert store.breaker.state is BreakerState.OPEN
    calls = len(reached)
    for _ in range(50):
        assert store.get("k").detail == "circuit open"
    assert len(reached) == calls  # answered by the breaker: none of the 50 reached the store
    # The store comes back: after the cooldown one probe goes through and closes the breaker.
    release.set()
    fake.hook = None
    deadline = time.monotonic() + 10
    while (result := store.get("k")).detail == "circuit open" and time.monotonic() < deadline:
        time.sleep(0.05)  # the cooldown (0.5 s) has not passed yet
    assert result.data == b"v"
    assert store.breaker.state.value == "closed"


def test_calls_queue_behind_busy_workers_within_the_bound() -> None:
    fake = FakeMooncake()
    store = client(fake, max_pending=8, op_timeout_s=60.0)  # 2 workers; the deadline only bounds the test
    store.put("k", b"v")
    gate = threading.Event()
    fake.hook = lambda name: gate.wait(60)  # each call holds its worker until every call is in
    with ThreadPoolExecutor(8) as pool:
        calls = [pool.submit(store.get, "k") for _ in range(8)]
        deadline = time.monotonic() + 30
        while store._workers._busy < 8:  # 2 running, 6 queued behind them
            assert time.monotonic() < deadline, "the calls never all queued"
            time.sleep(0.005)
        gate.set()
        results = [c.result() for c in calls]
    assert [r.data for r in results] == [b"v"] * 8  # queued, not refused


def test_stuck_workers_bound_the_threads_used() -> None:
    release = threading.Event()
    fake = FakeMooncake()
    store = client(fake, failures_to_open=100, max_pending=0)
    store.put("k", b"v")
    fake.hook = lambda name: release.wait(120)  # stuck until released, past the test's own limit
    before = threading.active_count()
    for _ in range(5):
        assert store.get("k").status is StoreStatus.UNAVAILABLE
    assert store.get("k").detail == "all store workers busy"
    assert threading.active_count() == before  # no thread per call
    release.set()
