"""EncoderCache against a real mooncake_master + mooncake_client holder on loopback."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from libs.cache.breaker import BreakerState
from libs.cache.cache import CacheConfig, EncoderCache, Source
from libs.cache.entry import CacheEntry, decode, encode
from libs.cache.store import MooncakeStoreClient, StoreConfig, StoreStatus
from libs.launch.store import StoreProcesses
from libs.model.types import Modality
from tests.support.cache import NS, SPECS, Metrics, make_entry

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def new_cache(
    procs: StoreProcesses, metrics: Metrics, *, specs: bool = True, op_timeout_s: float = 5.0, **config: int
) -> EncoderCache:
    # A generous deadline for the healthy-store tests: the machine is shared and sometimes slow.
    store = MooncakeStoreClient(
        StoreConfig(procs.master_address, op_timeout_s=op_timeout_s, failures_to_open=2, cooldown_s=30.0),
        meter=metrics.meter,
    )
    return EncoderCache(
        NS, store=store, config=CacheConfig(**config), specs=SPECS if specs else None, meter=metrics.meter
    )


async def never(*_: object) -> CacheEntry:
    raise AssertionError("computed although the store held the entry")


def test_entries_are_shared_between_two_encoders(shared_store: StoreProcesses) -> None:
    metrics = Metrics()
    first, second = new_cache(shared_store, metrics), new_cache(shared_store, metrics)
    try:
        for modality in Modality:
            key, entry = make_entry(b"shared", modality)
            assert first.publish(key, entry)
            assert first.flush(10)
            result = asyncio.run(second.get_or_compute(key, never))
            assert result.source is Source.STORE
            for name, tensor in entry.tensors.items():
                assert torch.equal(result.entry.tensors[name], tensor)
        counts = metrics.counters()
        assert counts[("epd.cache.publishes", "ok")] == 3, counts
        assert counts[("epd.cache.loads", "ok")] == 3, counts
    finally:
        first.close()
        second.close()


_PEER = """
import hashlib, sys
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", sys.argv[1]) == 0
print(hashlib.sha256(s.get(sys.argv[2])).hexdigest())
print(s.put(sys.argv[3], open(sys.argv[4], "rb").read()))
s.close()
"""


def test_entries_cross_process_boundaries(shared_store: StoreProcesses, tmp_path: Path) -> None:
    """Another process (a bare Mooncake client) reads what we published and publishes for us."""
    metrics = Metrics()
    cache = new_cache(shared_store, metrics)
    try:
        ours_key, ours = make_entry(b"from-this-process", Modality.VIDEO)
        theirs_key, theirs = make_entry(b"from-the-peer", Modality.AUDIO)
        cache.publish(ours_key, ours)
        assert cache.flush(10)
        blob_path = tmp_path / "theirs.bin"
        blob_path.write_bytes(encode(theirs))
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                _PEER,
                shared_store.master_address,
                ours_key.store_key,
                theirs_key.store_key,
                str(blob_path),
            ],
            capture_output=True,
            text=True,
            timeout=40,
            check=True,
        ).stdout.split()
        assert out[0] == hashlib.sha256(encode(ours)).hexdigest()
        assert out[1] == "0"
        loaded = asyncio.run(cache.lookup(theirs_key))
        assert loaded is not None and torch.equal(
            loaded.embeddings if False else loaded.tensors["embeddings"], theirs.tensors["embeddings"]
        )
    finally:
        cache.close()


def test_entry_survives_local_eviction(shared_store: StoreProcesses) -> None:
    metrics = Metrics()
    cache = new_cache(shared_store, metrics, local_max_entries=1)
    try:
        key_a, a = make_entry(b"evict-a")
        key_b, b = make_entry(b"evict-b")
        cache.publish(key_a, a)
        cache.publish(key_b, b)
        assert cache.flush(10)
        assert cache.lookup_local(key_a) is None
        result = asyncio.run(cache.get_or_compute(key_a, never))
        assert result.source is Source.STORE and result.entry.layout == a.layout
    finally:
        cache.close()


def test_poisoned_store_entry_is_replaced_by_a_good_one(shared_store: StoreProcesses) -> None:
    metrics = Metrics()
    cache = new_cache(shared_store, metrics)
    try:
        key, good = make_entry(b"poison-target")
        _, poisoned = make_entry(b"poison-target", namespace=NS.__class__(**{**NS.as_dict(), "revision": "r0"}))
        assert cache.store is not None
        assert cache.store.put(key.store_key, encode(poisoned)).ok

        async def compute() -> CacheEntry:
            return good

        result = asyncio.run(cache.get_or_compute(key, compute))
        assert result.source is Source.COMPUTED
        assert cache.flush(10)
        stored = cache.store.get(key.store_key)
        assert stored.data is not None and decode(stored.data, key=key, specs=SPECS).namespace == NS
        assert metrics.counters()[("epd.cache.invalid", "namespace_mismatch")] == 1
    finally:
        cache.close()


def test_store_full_is_a_miss_and_a_metric(shared_store: StoreProcesses) -> None:
    metrics = Metrics()
    cache = new_cache(shared_store, metrics, specs=False)
    try:
        key, big = make_entry(b"too-big-for-16-MiB", rows=4, width=5 * (1 << 18))  # 20 MiB of float32
        assert cache.publish(key, big)
        assert cache.flush(10)
        assert metrics.counters()[("epd.cache.publishes", "full")] == 1
        assert metrics.counters()[("epd.cache.store.ops", "put,full")] == 1
        cache.local.clear()
        assert asyncio.run(cache.lookup(key)) is None
    finally:
        cache.close()


def test_store_killed_mid_use_turns_into_misses(own_store: StoreProcesses) -> None:
    metrics = Metrics()
    cache = new_cache(own_store, metrics, op_timeout_s=1.0)
    assert own_store.holder is not None and own_store.master is not None
    try:
        key, entry = make_entry(b"before-the-crash")
        cache.publish(key, entry)
        assert cache.flush(10)
        cache.local.clear()

        # The holder (the memory) dies: the master still lists the key, the read fails.
        os.kill(own_store.holder.pid, signal.SIGKILL)
        own_store.holder.wait(5)
        assert asyncio.run(cache.lookup(key)) is None
        late_key, late = make_entry(b"after-the-holder")
        cache.publish(late_key, late)
        assert cache.flush(10)

        # Then the master dies too. Every request still completes (by computing) within our deadline;
        # by now the breaker is open (the holder failures opened it), so no call waits on the store.
        os.kill(own_store.master.pid, signal.SIGKILL)
        own_store.master.wait(5)
        computed = 0

        async def compute() -> CacheEntry:
            nonlocal computed
            computed += 1
            return entry

        for _ in range(3):
            cache.local.clear()
            started = time.monotonic()
            result = asyncio.run(cache.get_or_compute(key, compute))
            assert result.source is Source.COMPUTED
            # Bounded by our 1 s deadline, not the binding's own (generous: a loaded host stretches it).
            assert time.monotonic() - started < 10
        # Circuit open (for its 30 s cooldown): the next lookup is refused at once, not sent to a dead store.
        assert cache.store is not None and cache.store.breaker.state is BreakerState.OPEN
        cache.local.clear()
        asyncio.run(cache.get_or_compute(key, compute))
        assert computed == 4
        assert cache.flush(15)
        counts = metrics.counters()
        assert counts[("epd.cache.loads", "unavailable")] >= 2
        assert counts.get(("epd.cache.publishes", "unavailable"), 0) >= 1
        assert cache.store is not None
        assert cache.store.get(key.store_key).status is StoreStatus.UNAVAILABLE
    finally:
        cache.close(timeout=1)
