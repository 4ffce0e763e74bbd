"""EncoderCache with an in-memory store: lookup order, validation, single-flight, publishing."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from libs.cache.cache import CacheConfig, EncoderCache, Source
from libs.cache.entry import CacheEntry, EntryError, encode
from libs.model.types import Modality
from tests.support.cache import NS, SPECS, FakeStore, Metrics, make_entry

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


@pytest.fixture
def metrics() -> Metrics:
    return Metrics()


def new_cache(store: FakeStore | None, metrics: Metrics, **config: int) -> EncoderCache:
    return EncoderCache(NS, store=store, config=CacheConfig(**config), specs=SPECS, meter=metrics.meter)


class Computer:
    """A compute callback that counts calls and can be held back (`started` once it runs, held
    until `gate` is set) or made to fail."""

    def __init__(self, entry: CacheEntry, *, fail: Exception | None = None) -> None:
        self.entry = entry
        self.fail = fail
        self.calls = 0
        self.started = asyncio.Event()
        self.gate = asyncio.Event()
        self.gate.set()

    async def __call__(self) -> CacheEntry:
        self.calls += 1
        self.started.set()
        await self.gate.wait()
        await asyncio.sleep(0.01)
        if self.fail is not None:
            raise self.fail
        return self.entry


def test_lookup_order_local_then_store_then_miss(metrics: Metrics) -> None:
    store = FakeStore()
    key, entry = make_entry()
    store.data[key.store_key] = encode(entry)
    cache = new_cache(store, metrics)

    async def run() -> None:
        loaded = await cache.lookup(key)
        assert loaded is not None and loaded.layout == entry.layout
        assert await cache.lookup(key) is loaded  # promoted: the second lookup never reaches the store
        missing, _ = make_entry(b"other")
        assert await cache.lookup(missing) is None

    asyncio.run(run())
    assert [op for op, _ in store.calls] == ["get", "get"]
    counts = metrics.counters()
    assert counts[("epd.cache.lookups", "store_hit")] == 1
    assert counts[("epd.cache.lookups", "local_hit")] == 1
    assert counts[("epd.cache.lookups", "miss")] == 1
    assert counts[("epd.cache.loads", "ok")] == 1
    assert counts[("epd.cache.loads", "not_found")] == 1
    cache.close()


def test_sixteen_concurrent_callers_share_one_compute(metrics: Metrics) -> None:
    store = FakeStore()
    cache = new_cache(store, metrics)
    key, entry = make_entry()
    compute = Computer(entry)

    async def run() -> list[tuple[Source, bool]]:
        compute.gate.clear()
        tasks = [asyncio.ensure_future(cache.get_or_compute(key, compute)) for _ in range(16)]
        await asyncio.wait_for(compute.started.wait(), 10)  # the flight computes; every caller joined it first
        compute.gate.set()
        results = await asyncio.gather(*tasks)
        assert all(r.entry is entry for r in results)
        return [(r.source, r.shared) for r in results]

    outcomes = asyncio.run(run())
    assert compute.calls == 1
    assert outcomes.count((Source.COMPUTED, False)) == 1
    assert outcomes.count((Source.COMPUTED, True)) == 15
    assert [op for op, _ in store.calls].count("get") == 1  # one store load for all 16, too
    assert cache.flush(5)
    assert key.store_key in store.data  # published once computed
    counts = metrics.counters()
    assert counts[("epd.cache.computes", "")] == 1 and counts[("epd.cache.flight_joins", "")] == 15
    cache.close()


def test_compute_errors_reach_every_waiter_and_are_not_cached(metrics: Metrics) -> None:
    cache = new_cache(FakeStore(), metrics)
    key, entry = make_entry()
    failing = Computer(entry, fail=RuntimeError("tower exploded"))

    async def run() -> None:
        results = await asyncio.gather(*(cache.get_or_compute(key, failing) for _ in range(4)), return_exceptions=True)
        assert all(isinstance(r, RuntimeError) for r in results)
        good = Computer(entry)
        result = await cache.get_or_compute(key, good)  # nothing of the failure was remembered
        assert result.source is Source.COMPUTED and good.calls == 1

    asyncio.run(run())
    assert failing.calls == 1
    cache.close()


def test_a_cancelled_caller_does_not_cancel_the_shared_compute(metrics: Metrics) -> None:
    cache = new_cache(FakeStore(), metrics)
    key, entry = make_entry()
    compute = Computer(entry)

    async def run() -> None:
        compute.gate.clear()
        first = asyncio.ensure_future(cache.get_or_compute(key, compute))
        second = asyncio.ensure_future(cache.get_or_compute(key, compute))
        await asyncio.wait_for(compute.started.wait(), 10)  # the shared compute is under way, held
        first.cancel()  # the client of the request that started the flight went away
        compute.gate.set()
        assert (await second).entry is entry
        assert first.cancelled()

    asyncio.run(run())
    assert compute.calls == 1
    cache.close()


@pytest.mark.parametrize("poison", ["identity", "shape", "garbage"])
def test_poisoned_store_entries_are_never_served(metrics: Metrics, poison: str) -> None:
    store = FakeStore()
    key, entry = make_entry()
    if poison == "identity":
        _, bad = make_entry(namespace=dataclasses.replace(NS, weights_digest="sha256:evil"))
        blob = encode(bad)
    elif poison == "shape":
        _, bad = make_entry(width=8)  # right item, wrong embedding width for this encoder
        blob = encode(bad)
    else:
        blob = b"\x80\x04pickle" + bytes(64)
    store.data[key.store_key] = blob
    cache = new_cache(store, metrics)
    compute = Computer(entry)

    result = asyncio.run(cache.get_or_compute(key, compute))
    assert result.source is Source.COMPUTED and result.entry is entry and compute.calls == 1
    assert cache.flush(5)
    # Removed (a put of an existing key would keep the poisoned value), then the good entry published.
    ops = [op for op, k in store.calls if k == key.store_key]
    assert ops == ["get", "remove", "put"]
    assert store.data[key.store_key] == encode(entry)
    counts = metrics.counters()
    assert counts[("epd.cache.loads", "invalid")] == 1
    fault = {"identity": "namespace_mismatch", "shape": "spec_mismatch", "garbage": "bad_magic"}[poison]
    assert counts[("epd.cache.invalid", fault)] == 1
    cache.close()


def test_a_rejected_entry_is_not_read_again_while_its_removal_is_queued(metrics: Metrics) -> None:
    """A load-only caller rejects a poisoned entry (a CACHED_ONLY job); the computing retry that
    follows must not read and count it again before the publisher thread removed it: the removal is
    held here until after the retry (on a loaded host it can simply be late)."""
    store = FakeStore()
    key, entry = make_entry()
    _, bad = make_entry(namespace=dataclasses.replace(NS, weights_digest="sha256:evil"))
    store.data[key.store_key] = encode(bad)
    store.remove_gate = threading.Event()
    cache = new_cache(store, metrics)

    async def run() -> None:
        assert await cache.get_or_load(key) is None
        result = await cache.get_or_compute(key, Computer(entry))
        assert result.source is Source.COMPUTED and result.entry is entry

    asyncio.run(run())
    store.remove_gate.set()
    assert cache.flush(5)
    assert [op for op, k in store.calls if k == key.store_key] == ["get", "remove", "put"]
    assert store.data[key.store_key] == encode(entry)
    assert metrics.counters()[("epd.cache.invalid", "namespace_mismatch")] == 1
    assert asyncio.run(cache.lookup(key)) is entry
    cache.close()


def test_a_computed_entry_for_the_wrong_key_is_refused(metrics: Metrics) -> None:
    cache = new_cache(FakeStore(), metrics)
    key, _ = make_entry(b"one")
    _, other = make_entry(b"two")
    with pytest.raises(EntryError):
        asyncio.run(cache.get_or_compute(key, Computer(other)))
    assert cache.lookup_local(key) is None and cache.stats().local.entries == 0
    cache.close()


def test_entry_survives_local_eviction_through_the_store(metrics: Metrics) -> None:
    store = FakeStore()
    cache = new_cache(store, metrics, local_max_entries=1)
    key_a, a = make_entry(b"a")
    key_b, b = make_entry(b"b")
    cache.publish(key_a, a)
    cache.publish(key_b, b)  # evicts a locally
    assert cache.flush(5)
    assert cache.lookup_local(key_a) is None
    loaded = asyncio.run(cache.lookup(key_a))
    assert loaded is not None and loaded.layout == a.layout
    assert metrics.counters()[("epd.cache.local.evictions", "")] >= 1
    cache.close()


def test_store_down_is_a_miss_and_compute_still_serves(metrics: Metrics) -> None:
    store = FakeStore()
    store.down = True
    cache = new_cache(store, metrics)
    key, entry = make_entry(modality=Modality.AUDIO)
    result = asyncio.run(cache.get_or_compute(key, Computer(entry)))
    assert result.source is Source.COMPUTED
    assert cache.flush(5)
    counts = metrics.counters()
    assert counts[("epd.cache.loads", "unavailable")] == 1
    assert counts[("epd.cache.publishes", "unavailable")] == 1
    cache.close()


def test_publish_is_off_the_critical_path_and_drops_when_the_queue_is_full(metrics: Metrics) -> None:
    store = FakeStore()
    store.put_gate = threading.Event()  # the store accepts nothing until released
    cache = new_cache(store, metrics, publish_queue=2)
    accepted = [cache.publish(*make_entry(bytes([i]))) for i in range(6)]
    # One is held by the publisher thread, two wait in the queue; the rest are dropped, not blocked on.
    assert accepted.count(True) in (2, 3) and accepted[:2] == [True, True]
    assert cache.stats().local.entries == 6  # every entry is still served locally
    store.put_gate.set()
    assert cache.flush(5)
    dropped = metrics.counters()[("epd.cache.publishes", "dropped")]
    assert dropped == accepted.count(False) and dropped >= 3
    cache.close()


def test_no_store_configured_is_local_only(metrics: Metrics) -> None:
    cache = new_cache(None, metrics)
    key, entry = make_entry()
    assert asyncio.run(cache.lookup(key)) is None
    assert cache.publish(key, entry) is False
    assert asyncio.run(cache.lookup(key)) is entry
    cache.close()


def test_store_loads_are_cache_load_stage_spans(metrics: Metrics, monkeypatch: pytest.MonkeyPatch) -> None:
    import libs.telemetry.stages as stages

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(stages, "_tracer", provider.get_tracer("test"))
    store = FakeStore()
    key, entry = make_entry()
    store.data[key.store_key] = encode(entry)
    cache = new_cache(store, metrics)
    asyncio.run(cache.lookup(key))
    spans = [s for s in exporter.get_finished_spans() if s.name == "cache.load"]
    assert len(spans) == 1
    attrs = dict(spans[0].attributes or {})
    assert attrs["epd.stage"] == "cache_load" and attrs["epd.cache.status"] == "ok"
    assert attrs["epd.cache.key"] == key.store_key
    cache.close()


def test_load_only_callers_share_one_store_load_and_never_compute(metrics: Metrics) -> None:
    store = FakeStore()
    key, entry = make_entry()
    store.data[key.store_key] = encode(entry)
    missing, _ = make_entry(b"not stored")
    cache = new_cache(store, metrics)

    async def run() -> None:
        results = await asyncio.gather(*(cache.get_or_load(key) for _ in range(8)))
        assert all(r is not None and r.source is Source.STORE for r in results)
        assert await cache.get_or_load(missing) is None

    asyncio.run(run())
    gets = [k for op, k in store.calls if op == "get"]
    assert gets == [key.store_key, missing.store_key]  # one load per key for all callers
    assert ("epd.cache.computes", "") not in metrics.counters()
    cache.close()


def test_load_only_and_computing_callers_share_flights(metrics: Metrics) -> None:
    cache = new_cache(FakeStore(), metrics)
    key, entry = make_entry()
    compute = Computer(entry)

    async def joins_a_computing_flight() -> None:
        compute.gate.clear()
        computing = asyncio.ensure_future(cache.get_or_compute(key, compute))
        await asyncio.wait_for(compute.started.wait(), 10)  # its flight computes, held
        loading = asyncio.ensure_future(cache.get_or_load(key))
        await asyncio.sleep(0)  # one turn: the load joins the flight at its first step (no await before)
        compute.gate.set()
        loaded = await loading
        assert loaded is not None and loaded.entry is entry and loaded.shared
        await computing

    async def computes_after_a_load_only_flight_missed() -> None:
        other, other_entry = make_entry(b"other item")
        loading = asyncio.ensure_future(cache.get_or_load(other))
        computing = asyncio.ensure_future(cache.get_or_compute(other, Computer(other_entry)))
        assert await loading is None
        assert (await computing).source is Source.COMPUTED

    asyncio.run(joins_a_computing_flight())
    asyncio.run(computes_after_a_load_only_flight_missed())
    assert compute.calls == 1
    cache.close()
