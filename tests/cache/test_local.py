from __future__ import annotations

import threading

import pytest

from libs.cache.local import LocalLru

pytestmark = pytest.mark.unit


def lru(max_bytes: int = 100, max_entries: int = 10) -> LocalLru[bytes]:
    return LocalLru(max_bytes, max_entries, len)


def test_bounded_in_bytes_evicting_least_recently_used() -> None:
    cache = lru(max_bytes=100)
    cache.put("a", b"x" * 40)
    cache.put("b", b"x" * 40)
    assert cache.get("a") is not None  # a is now more recent than b
    assert cache.put("c", b"x" * 40) == ["b"]
    assert "a" in cache and "c" in cache and "b" not in cache
    stats = cache.stats()
    assert (stats.entries, stats.bytes, stats.evictions) == (2, 80, 1)


def test_bounded_in_entries() -> None:
    cache = lru(max_bytes=10_000, max_entries=3)
    for name in "abcde":
        cache.put(name, b"1")
    assert [n for n in "abcde" if n in cache] == ["c", "d", "e"]
    assert cache.stats().evictions == 2


def test_value_larger_than_the_budget_is_rejected_and_evicts_nothing() -> None:
    cache = lru(max_bytes=100)
    cache.put("a", b"x" * 60)
    assert cache.put("huge", b"x" * 101) == []
    assert "a" in cache and "huge" not in cache
    assert cache.stats().rejected == 1


def test_replacing_a_key_accounts_bytes_once() -> None:
    cache = lru(max_bytes=100)
    cache.put("a", b"x" * 60)
    cache.put("a", b"x" * 70)
    assert cache.stats().bytes == 70 and cache.stats().entries == 1
    assert cache.pop("a") == b"x" * 70 and cache.stats().bytes == 0
    assert cache.pop("a") is None


def test_hits_and_misses_are_counted() -> None:
    cache = lru()
    cache.put("a", b"1")
    cache.get("a")
    cache.get("zz")
    assert (cache.stats().hits, cache.stats().misses) == (1, 1)


def test_bounds_hold_under_concurrent_use() -> None:
    cache = lru(max_bytes=1000, max_entries=50)

    def worker(n: int) -> None:
        for i in range(500):
            cache.put(f"{n}-{i % 70}", b"x" * (i % 37 + 1))
            cache.get(f"{(n + 1) % 4}-{i % 70}")

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = cache.stats()
    assert stats.bytes <= 1000 and stats.entries <= 50
    assert stats.hits + stats.misses == 2000


def test_rejects_non_positive_bounds() -> None:
    with pytest.raises(ValueError):
        lru(max_bytes=0)
