"""The encoder-output cache: local LRU → shared store → compute, with validated reuse.

Lookup order for a key: the in-process LRU; then the Mooncake Store (a `cache_load` stage span; the
loaded entry is decoded and validated against the key's namespace, the key and the modality's
embedding spec, and promoted into the LRU); then the caller's compute. Computed entries go into the
LRU at once and to the store from a background thread (bounded queue; drops are counted), never on
the request's critical path. Store trouble is a miss with a warning and a metric, never an error.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import queue
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from opentelemetry import metrics, trace

from libs.cache.entry import CacheEntry, EntryError, check_entry, decode, encode
from libs.cache.flight import SingleFlight
from libs.cache.keys import CacheKey, Namespace
from libs.cache.local import LocalLru, LruStats
from libs.cache.store import StoreClient, StoreStatus
from libs.model.types import EmbeddingSpec, Modality
from libs.telemetry.stages import stage

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("epd")


class Source(enum.Enum):
    LOCAL = "local"
    STORE = "store"
    COMPUTED = "computed"


@dataclass(frozen=True)
class CacheResult:
    entry: CacheEntry
    source: Source
    shared: bool  # this caller joined a flight another caller started


@dataclass(frozen=True)
class CacheConfig:
    local_max_bytes: int = 1 << 30
    local_max_entries: int = 4096
    publish_queue: int = 64  # entries waiting for the store; more are dropped (and counted)


@dataclass(frozen=True)
class CacheStats:
    counts: dict[str, int]  # "<counter>.<label>", e.g. "lookups.local_hit", "publishes.dropped"
    local: LruStats
    pending_publishes: int


class _Metrics:
    """OTel counters plus plain tallies (for `stats()` and tests)."""

    def __init__(self, meter: metrics.Meter) -> None:
        self._counters = {
            "lookups": meter.create_counter("epd.cache.lookups", description="Cache lookups by result"),
            "loads": meter.create_counter("epd.cache.loads", description="Store loads by status"),
            "publishes": meter.create_counter("epd.cache.publishes", description="Store publishes by status"),
            "invalid": meter.create_counter("epd.cache.invalid", description="Entries rejected, by fault"),
            "computes": meter.create_counter("epd.cache.computes", description="Items computed after a miss"),
            "joins": meter.create_counter("epd.cache.flight_joins", description="Callers that shared a flight"),
            "errors": meter.create_counter("epd.cache.errors", description="Cache-side failures, by reason"),
            "evictions": meter.create_counter("epd.cache.local.evictions", description="Local LRU evictions"),
        }
        self._labels = {
            "lookups": "epd.cache.result",
            "loads": "epd.cache.status",
            "publishes": "epd.cache.status",
            "invalid": "epd.cache.fault",
            "errors": "epd.cache.reason",
        }
        self._tally: Counter[str] = Counter()
        self._lock = threading.Lock()

    def add(self, name: str, label: str = "", n: int = 1) -> None:
        attrs = {self._labels[name]: label} if name in self._labels else {}
        self._counters[name].add(n, attrs)
        with self._lock:
            self._tally[f"{name}.{label}" if label else name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._tally)


class EncoderCache:
    """One per encoder (or router) process, used from one event loop."""

    def __init__(
        self,
        namespace: Namespace,
        *,
        store: StoreClient | None = None,
        config: CacheConfig | None = None,
        specs: Mapping[Modality, EmbeddingSpec] | None = None,
        meter: metrics.Meter | None = None,
    ) -> None:
        self.namespace = namespace
        self.config = config or CacheConfig()
        self.store = store
        self.specs = dict(specs or {})
        self.local: LocalLru[CacheEntry] = LocalLru(
            self.config.local_max_bytes, self.config.local_max_entries, lambda e: e.nbytes
        )
        self._metrics = _Metrics(meter or metrics.get_meter("epd"))
        self._flights: SingleFlight[tuple[CacheEntry, Source] | None] = SingleFlight()
        # Jobs for the publisher thread, in order: (key, entry) puts, (key, None) removals; None stops it.
        self._queue: queue.Queue[tuple[CacheKey, CacheEntry | None, trace.SpanContext] | None] = queue.Queue(
            self.config.publish_queue
        )
        self._queued: set[str] = set()
        # Keys whose stored entry was rejected and whose removal is still queued: a load of one is a
        # miss without reading the store (it would read, reject and count the same entry again).
        self._rejected: set[str] = set()
        self._queued_lock = threading.Lock()
        self._publisher: threading.Thread | None = None
        if store is not None:
            self._publisher = threading.Thread(target=self._publish_loop, name="cache-publish", daemon=True)
            self._publisher.start()

    def key(self, mm_hash: str) -> CacheKey:
        return CacheKey(self.namespace, mm_hash)

    # -- lookups ---------------------------------------------------------------------------------------

    def lookup_local(self, key: CacheKey) -> CacheEntry | None:
        entry = self.local.get(key.store_key)
        if entry is not None:
            self._metrics.add("lookups", "local_hit")
        return entry

    async def lookup(self, key: CacheKey) -> CacheEntry | None:
        """Local, then store (promoting a valid store entry into the LRU); None on a miss."""
        entry = self.lookup_local(key)
        if entry is None:
            entry = await self._load(key)
            self._metrics.add("lookups", "store_hit" if entry is not None else "miss")
        return entry

    async def get_or_compute(self, key: CacheKey, compute: Callable[[], Awaitable[CacheEntry]]) -> CacheResult:
        """The entry for `key`, computing it at most once across concurrent callers.

        A compute error reaches every caller of that flight and is not cached; a computed entry that
        fails validation raises `EntryError` and is not cached either.
        """
        result = await self._shared(key, compute)
        if result is None:  # joined a load-only flight that missed: start one that computes
            result = await self._shared(key, compute)
        assert result is not None, "a flight with a compute step always has an entry"
        return result

    async def get_or_load(self, key: CacheKey) -> CacheResult | None:
        """The entry for `key` from the LRU or the store, never computed; None on a miss. Concurrent
        callers share one store load, and one joining a computing flight gets the computed entry."""
        return await self._shared(key, None)

    async def _shared(self, key: CacheKey, compute: Callable[[], Awaitable[CacheEntry]] | None) -> CacheResult | None:
        entry = self.lookup_local(key)
        if entry is not None:
            return CacheResult(entry, Source.LOCAL, shared=False)
        found, joined = await self._flights.run(key.store_key, lambda: self._fill(key, compute))
        if joined:
            self._metrics.add("joins")
        return None if found is None else CacheResult(found[0], found[1], shared=joined)

    async def _fill(
        self, key: CacheKey, compute: Callable[[], Awaitable[CacheEntry]] | None
    ) -> tuple[CacheEntry, Source] | None:
        entry = self.local.get(key.store_key)  # a flight that landed just before this one started
        if entry is not None:
            self._metrics.add("lookups", "local_hit")
            return entry, Source.LOCAL
        entry = await self._load(key)
        self._metrics.add("lookups", "store_hit" if entry is not None else "miss")
        if entry is not None:
            return entry, Source.STORE
        if compute is None:
            return None
        self._metrics.add("computes")
        entry = await compute()
        self.publish(key, entry)
        return entry, Source.COMPUTED

    async def _load(self, key: CacheKey) -> CacheEntry | None:
        if self.store is None:
            return None
        with self._queued_lock:
            if key.store_key in self._rejected:
                return None
        with stage("cache.load", "cache_load", **{"epd.cache.key": key.store_key}) as span:
            result = await self.store.aget(key.store_key)
            span.set_attribute("epd.cache.status", result.status.value)
            if result.status is not StoreStatus.OK or result.data is None:
                self._metrics.add("loads", result.status.value)
                return None
            span.set_attribute("epd.cache.bytes", len(result.data))
            try:
                entry = decode(result.data, key=key, specs=self.specs)
            except EntryError as exc:
                span.set_attribute("epd.cache.fault", exc.fault.value)
                self._reject(key, exc)
                return None
        self._metrics.add("loads", "ok")
        self._put_local(key, entry)
        return entry

    def _reject(self, key: CacheKey, exc: EntryError) -> None:
        """A stored entry that must not be served: count it, warn, and remove it so a good one can
        take its place (a put of an existing key keeps the old value)."""
        self._metrics.add("loads", "invalid")
        self._metrics.add("invalid", exc.fault.value)
        log.warning("cache entry %s rejected: %s", key.store_key, exc)
        # Removed from the publisher thread: off the event loop, and ahead of the good entry's put.
        with self._queued_lock:
            try:
                self._queue.put_nowait((key, None, trace.get_current_span().get_span_context()))
            except queue.Full:
                self._metrics.add("errors", "remove_dropped")
                return
            self._rejected.add(key.store_key)

    def _put_local(self, key: CacheKey, entry: CacheEntry) -> None:
        evicted = self.local.put(key.store_key, entry)
        if evicted:
            self._metrics.add("evictions", n=len(evicted))

    # -- publishing ------------------------------------------------------------------------------------

    def publish(self, key: CacheKey, entry: CacheEntry) -> bool:
        """Cache a freshly computed entry: into the LRU now, into the store in the background.

        Raises `EntryError` if the entry does not match the key (a bug upstream: never cache it).
        Returns False when the store publish was dropped (queue full) or there is no store.
        """
        check_entry(entry, key=key, specs=self.specs)
        self._put_local(key, entry)
        if self.store is None:
            return False
        with self._queued_lock:
            if key.store_key in self._queued:
                return True
            try:
                self._queue.put_nowait((key, entry, trace.get_current_span().get_span_context()))
            except queue.Full:
                self._metrics.add("publishes", "dropped")
                log.warning("cache publish queue full; dropped %s", key.store_key)
                return False
            self._queued.add(key.store_key)
        return True

    def _publish_loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            key, entry, parent = job
            try:
                if entry is None:
                    removed = self.store.remove(key.store_key) if self.store is not None else None
                    if removed is not None and removed.status not in (StoreStatus.OK, StoreStatus.NOT_FOUND):
                        self._metrics.add("errors", "remove_failed")
                else:
                    self._publish_one(key, entry, parent)
            except Exception as exc:  # the publisher thread must survive anything
                self._metrics.add("publishes", "error")
                log.warning("cache publish of %s failed: %r", key.store_key, exc)
            finally:
                with self._queued_lock:
                    (self._queued if entry is not None else self._rejected).discard(key.store_key)
                self._queue.task_done()

    def _publish_one(self, key: CacheKey, entry: CacheEntry, parent: trace.SpanContext) -> None:
        assert self.store is not None
        links = [trace.Link(parent)] if parent.is_valid else []
        with _tracer.start_as_current_span("cache.publish", links=links) as span:
            blob = encode(entry)
            result = self.store.put(key.store_key, blob)
            span.set_attributes(
                {"epd.cache.key": key.store_key, "epd.cache.bytes": len(blob), "epd.cache.status": result.status.value}
            )
        self._metrics.add("publishes", result.status.value)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until queued publishes are done (tests, shutdown). False on timeout."""
        done = threading.Event()

        def waiter() -> None:
            self._queue.join()
            done.set()

        threading.Thread(target=waiter, daemon=True).start()
        return done.wait(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Finish pending publishes (up to `timeout`), stop the publisher and close the store."""
        if self._publisher is not None:
            self.flush(timeout)
            with contextlib.suppress(queue.Full):
                self._queue.put_nowait(None)
            self._publisher.join(timeout=1.0)
            self._publisher = None
        if self.store is not None:
            self.store.close()

    def stats(self) -> CacheStats:
        return CacheStats(self._metrics.snapshot(), self.local.stats(), self._queue.qsize())
