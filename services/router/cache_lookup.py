"""The router's half of the encoder cache: is an item already in the shared store?

Before dispatching an item, the router hashes it (`libs.cache.keys.wire_content_hash`, the digest the
encoder keys its cache by) and asks the Mooncake Store whether "<encoder key prefix>/<hash>" exists:
a metadata call to the master, no tensor bytes. On a hit the encoder job carries
`CACHE_POLICY_CACHED_ONLY`, so no encoder computes and the item skips the compute queue; the
encoder still loads the entry into its pool and prefill reads it through the usual handle. The
router never moves tensor bytes itself. A store that is down, slow or not configured is a miss
(the normal path), never an error.
"""

from __future__ import annotations

import asyncio

from opentelemetry import metrics

from libs.cache.keys import wire_content_hash
from libs.cache.store import StoreClient, StoreStatus
from libs.contract.epd.v1 import media_pb2
from libs.contract.errors import InvalidArgument
from libs.serving.media_source import media_bytes
from libs.telemetry.stages import stage

_HASH_INLINE_MAX = 256 << 10  # larger items are hashed off the event loop


async def item_hash(item: media_pb2.MediaItem, max_bytes: int) -> str | None:
    """The content hash of an item whose bytes the router holds (inline or a data: URI), else None."""
    try:
        data = media_bytes(item, "media", max_bytes=max_bytes)
    except InvalidArgument:
        return None  # file:// (only encoders read those) or malformed: the encoder decides
    if len(data) <= _HASH_INLINE_MAX:
        return wire_content_hash(item, data)
    return await asyncio.to_thread(wire_content_hash, item, data)


class CacheLookup:
    """Store existence checks, traced as a `cache_load` stage and counted by result."""

    def __init__(self, store: StoreClient | None, meter: metrics.Meter | None = None) -> None:
        self.store = store
        meter = meter or metrics.get_meter("epd")
        self._lookups = meter.create_counter(
            "epd.router.cache.lookups", description="Router store lookups before dispatch, by result"
        )

    async def cached(self, store_key: str) -> bool:
        """Whether the store holds `store_key` now (False when the store cannot say)."""
        if self.store is None:
            return False
        with stage("router.cache_lookup", "cache_load", **{"epd.cache.key": store_key}) as span:
            result = await self.store.aexists(store_key)
            outcome = {StoreStatus.OK: "hit", StoreStatus.NOT_FOUND: "miss"}.get(result.status, "unavailable")
            span.set_attribute("epd.cache.result", outcome)
        self._lookups.add(1, {"epd.cache.result": outcome})
        return outcome == "hit"

    def connect(self, _address: str = "") -> None:
        """Set the store client up now rather than inside the first lookup (whose deadline it would miss)."""
        if self.store is not None:
            self.store.connect()

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
