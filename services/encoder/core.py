"""Encoder core: media items -> embeddings kept in this process's registered pool, plus layout.

Per `Encode` call: validate, resolve each item's bytes, get each item's embeddings, then place
them in a pool slot and return its handle (NIXL) - or the bytes themselves when the consumer
accepts only INLINE. Embeddings come from the tower (items of one modality in one forward, on the
engine thread) or, with a cache, from the local LRU, then the shared store, then the tower;
`CACHE_POLICY_CACHED_ONLY` (the router's short-circuit after a store hit) never runs the tower and
answers NOT_FOUND for an item not cached. Slots are freed by the consumer's completion
notification, `ReleaseLeases`, or lease expiry. If anything fails after some items were placed,
those leases are released before the error goes back.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from opentelemetry import trace

from libs.cache.cache import EncoderCache
from libs.cache.entry import CacheEntry
from libs.contract.epd.v1 import encoder_pb2, layout_pb2, tensor_pb2
from libs.contract.errors import NotFound
from libs.contract.validation import Limits, validate_encode_request
from libs.runtime.encoder_runner import EncoderRunner, media_hash
from libs.runtime.types import EncodedItem, MediaInput
from libs.serving import convert
from libs.serving.compute_thread import ComputeThread
from libs.serving.encoding import encode_items
from libs.serving.media_source import media_bytes
from libs.serving.transport import Transport
from libs.telemetry.stages import stage


class EncoderCore:
    def __init__(
        self,
        runner: EncoderRunner,
        transport: Transport,
        engine: ComputeThread,
        *,
        limits: Limits | None = None,
        file_root: Path | None = None,
        cache: EncoderCache | None = None,
    ) -> None:
        self.runner = runner
        self.transport = transport
        self.engine = engine
        self.limits = limits or Limits()
        self.file_root = file_root
        self.cache = cache

    async def encode(self, request: encoder_pb2.EncodeRequest) -> encoder_pb2.EncodeResponse:
        validate_encode_request(request, self.limits)
        media = [
            convert.media_input(
                item.media,
                item.item_index,
                media_bytes(
                    item.media,
                    f"items[{i}].media",
                    max_bytes=self.limits.max_inline_media_bytes,
                    file_root=self.file_root,
                ),
            )
            for i, item in enumerate(request.items)
        ]
        if request.cache_policy == encoder_pb2.CACHE_POLICY_CACHED_ONLY:
            encoded = list(await asyncio.gather(*(self._from_cache(m, i) for i, m in enumerate(media))))
        elif self.cache is None:
            encoded = await encode_items(self.engine, self.runner, media)
        else:
            encoded = list(await asyncio.gather(*(self._through_cache(self.cache, m) for m in media)))
        nixl = tensor_pb2.TRANSPORT_KIND_NIXL in request.accepted_transports
        producer = self.transport.producer
        assert producer is not None, "the transport is bound once the server listens"
        put = producer.put if nixl else producer.put_inline
        response = encoder_pb2.EncodeResponse()
        try:
            with stage("encoder.publish", "transfer") as span:
                for item in encoded:
                    handle = await self.transport.run(
                        put, item.tensors, on_abandon=lambda h: producer.release([h.lease_id])
                    )
                    layout = convert.item_layout_to_wire(item.layout)
                    response.items.append(layout_pb2.EncodedMedia(layout=layout, embeddings=handle))
                span.set_attribute(
                    "epd.transfer.bytes", sum(h.embeddings.tensors[0].spec.nbytes for h in response.items)
                )
        except BaseException:
            producer.release(i.embeddings.lease_id for i in response.items)
            raise
        return response

    async def _from_cache(self, media: MediaInput, position: int) -> EncodedItem:
        """CACHE_POLICY_CACHED_ONLY: the local cache or the shared store, never the tower."""
        if self.cache is None:
            raise NotFound(f"items[{position}]: this encoder keeps no cache")
        result = await self.cache.get_or_load(self.cache.key(media_hash(media)))
        if result is None:
            raise NotFound(f"items[{position}]: not in the encoder cache or the shared store")
        trace.get_current_span().add_event(
            "epd.cache", {"epd.cache.source": result.source.value, "epd.cache.shared": result.shared}
        )
        return result.entry.to_item(media.item_index)

    async def _through_cache(self, cache: EncoderCache, media: MediaInput) -> EncodedItem:
        """Local cache, then the shared store, then the tower; concurrent requests for one item
        compute it once (single-flight) and later ones reuse it."""

        async def compute() -> CacheEntry:
            (item,) = await encode_items(self.engine, self.runner, [media])
            return CacheEntry.from_item(cache.namespace, item)

        result = await cache.get_or_compute(cache.key(media_hash(media)), compute)
        trace.get_current_span().add_event(
            "epd.cache", {"epd.cache.source": result.source.value, "epd.cache.shared": result.shared}
        )
        return result.entry.to_item(media.item_index)
