"""In-process LRU bounded in bytes and in entries."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

V = TypeVar("V")


@dataclass(frozen=True)
class LruStats:
    entries: int
    bytes: int
    hits: int
    misses: int
    evictions: int
    rejected: int  # values larger than the whole budget, never stored


class LocalLru(Generic[V]):
    """Thread-safe LRU; `size_of(value)` gives each value's bytes. Evicts least recently used first."""

    def __init__(self, max_bytes: int, max_entries: int, size_of: Callable[[V], int]) -> None:
        if max_bytes <= 0 or max_entries <= 0:
            raise ValueError("max_bytes and max_entries must be positive")
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._size_of = size_of
        self._items: OrderedDict[str, tuple[V, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._hits = self._misses = self._evictions = self._rejected = 0

    def get(self, key: str) -> V | None:
        with self._lock:
            found = self._items.get(key)
            if found is None:
                self._misses += 1
                return None
            self._items.move_to_end(key)
            self._hits += 1
            return found[0]

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._items

    def put(self, key: str, value: V) -> list[str]:
        """Store `value`; returns the keys evicted to make room (empty if it was rejected as too large)."""
        size = self._size_of(value)
        evicted: list[str] = []
        with self._lock:
            if size > self.max_bytes:
                self._rejected += 1
                return evicted
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._items[key] = (value, size)
            self._bytes += size
            while self._bytes > self.max_bytes or len(self._items) > self.max_entries:
                victim, (_, victim_size) = self._items.popitem(last=False)
                self._bytes -= victim_size
                self._evictions += 1
                evicted.append(victim)
        return evicted

    def pop(self, key: str) -> V | None:
        with self._lock:
            found = self._items.pop(key, None)
            if found is None:
                return None
            self._bytes -= found[1]
            return found[0]

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0

    def stats(self) -> LruStats:
        with self._lock:
            return LruStats(len(self._items), self._bytes, self._hits, self._misses, self._evictions, self._rejected)
