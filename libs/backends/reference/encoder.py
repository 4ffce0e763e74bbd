"""The encoder on the reference runtime (the E role): media items -> embeddings kept in this
process's registered pool, plus layout.

Per `Encode` call: resolve each item's bytes, get each item's embeddings, then place them in a
pool slot and return its handle (NIXL) - or the bytes themselves when the consumer accepts only
INLINE. Embeddings come from the tower (items of one modality in one forward, on the compute
thread, with other calls' images that queued meanwhile: `EncodeBatcher`) or, with a cache, from the
local LRU, then the shared store, then the tower;
`CACHE_POLICY_CACHED_ONLY` (the router's short-circuit after a store hit) never runs the tower and
answers NOT_FOUND for an item not cached. Slots are freed by the consumer's completion
notification, `ReleaseLeases`, or lease expiry. If anything fails after some items were placed,
those leases are released before the error goes back.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch
from opentelemetry import trace

from libs.backends.api import EncoderBackend
from libs.backends.in_flight import InFlight
from libs.backends.settings import EncoderBackendSettings
from libs.cache.cache import CacheConfig, EncoderCache
from libs.cache.entry import CacheEntry
from libs.cache.keys import CACHED_ONLY, Namespace
from libs.cache.store import MooncakeStoreClient, StoreConfig
from libs.contract.epd.v1 import encoder_pb2, layout_pb2, service_info_pb2, tensor_pb2
from libs.contract.errors import NotFound
from libs.contract.validation import Limits
from libs.model import types as eng
from libs.model.content import media_hash
from libs.model.dtypes import dtype_name
from libs.model.types import EncodedItem, MediaInput
from libs.runtime.encoder_runner import EncoderRunner
from libs.serving import convert
from libs.serving.compute_thread import ComputeThread
from libs.serving.encoding import EncodeBatcher
from libs.serving.media_source import job_media
from libs.serving.service_info import model_identity
from libs.serving.speech import speech_capabilities
from libs.serving.transport import Transport, transfer_config
from libs.telemetry.stages import stage

# An item's embeddings up to this size are copied into the pool on the event loop: a hop to the
# transfer threads and back costs more than copying a small item.
LOOP_PUT_BYTES = 1 << 20


class ReferenceEncoder(EncoderBackend):
    """`EncoderBackend` on libs/runtime."""

    name = "reference"
    transport: Transport  # the service's: this backend moves every tensor with it

    def __init__(
        self,
        runner: EncoderRunner,
        transport: Transport,
        *,
        max_running: int,
        limits: Limits | None = None,
        file_root: Path | None = None,
        cache: EncoderCache | None = None,
        store: MooncakeStoreClient | None = None,
        batch_items: int = 16,
    ) -> None:
        self.runner = runner
        self.weights_digest = runner.weights_digest
        self.transport = transport
        self.max_running = max_running
        self.in_flight = InFlight()
        self.thread = ComputeThread("encoder")
        self.batcher = EncodeBatcher(self.thread, runner, max_items=batch_items)
        self.limits = limits or Limits()
        self.file_root = file_root
        self.cache = cache
        self.store = store  # the cache's shared store, when one is configured

    def embedding_specs(self) -> list[eng.EmbeddingSpec]:
        return list(self.runner.specs.values())

    def capabilities(self) -> tuple[str, ...]:
        return (*((CACHED_ONLY,) if self.cache is not None else ()), *speech_capabilities(self.runner.adapter))

    def extend_info(self, info: service_info_pb2.ServiceInfo) -> None:
        if self.cache is not None:
            info.encoder_cache.CopyFrom(
                service_info_pb2.EncoderCacheInfo(
                    key_prefix=self.cache.namespace.key_prefix,
                    shared_store=self.store is not None,
                    local_capacity_bytes=self.cache.config.local_max_bytes,
                )
            )

    def serving_at(self, address: str) -> None:
        self.transport.bind_address(address)
        # Set the store client up before taking requests (inside the first lookup, the set-up would
        # exceed the lookup's deadline: a miss), and only once our gRPC port is bound: Mooncake's
        # transfer engine picks its own listening ports and must not take the one we announce.
        if self.store is not None:
            self.store.connect()

    async def encode(self, request: encoder_pb2.EncodeRequest, deadline: float | None) -> encoder_pb2.EncodeResponse:
        with self.in_flight.track(request.request_id):
            return await self._encode(request)

    async def _encode(self, request: encoder_pb2.EncodeRequest) -> encoder_pb2.EncodeResponse:
        media = job_media(request, max_bytes=self.limits.max_inline_media_bytes, file_root=self.file_root)
        if request.cache_policy == encoder_pb2.CACHE_POLICY_CACHED_ONLY:
            encoded = list(await asyncio.gather(*(self._from_cache(m, i) for i, m in enumerate(media))))
        else:
            # Item by item, each error naming its item: the batcher runs the items that queue
            # together (all of a call's images) in one forward.
            cache = self.cache
            encoded = list(
                await asyncio.gather(
                    *(
                        self._through_cache(cache, m, i) if cache is not None else self._computed(m, i)
                        for i, m in enumerate(media)
                    )
                )
            )
        nixl = tensor_pb2.TRANSPORT_KIND_NIXL in request.accepted_transports
        producer = self.transport.producer
        assert producer is not None, "the transport is bound once the server listens"
        put = producer.put if nixl else producer.put_inline
        response = encoder_pb2.EncodeResponse()
        try:
            with stage("encoder.publish", "transfer") as span:
                for item in encoded:
                    if sum(t.nbytes for t in item.tensors.values()) <= LOOP_PUT_BYTES:
                        handle = put(item.tensors)
                    else:
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

    async def _computed(self, media: MediaInput, position: int) -> EncodedItem:
        (item,) = await self.batcher.encode([media], field_prefix=f"items[{position}]")
        return item

    async def _through_cache(self, cache: EncoderCache, media: MediaInput, position: int) -> EncodedItem:
        """Local cache, then the shared store, then the tower; concurrent requests for one item
        compute it once (single-flight) and later ones reuse it."""

        async def compute() -> CacheEntry:
            return CacheEntry.from_item(cache.namespace, await self._computed(media, position))

        result = await cache.get_or_compute(cache.key(media_hash(media)), compute)
        trace.get_current_span().add_event(
            "epd.cache", {"epd.cache.source": result.source.value, "epd.cache.shared": result.shared}
        )
        return result.entry.to_item(media.item_index)

    async def close(self) -> None:
        if self.cache is not None:
            self.cache.close()
        self.thread.shutdown()
        self.transport.close()


async def start(settings: EncoderBackendSettings) -> ReferenceEncoder:
    """Load the tower; the transport only produces (the embeddings prefill reads)."""
    torch.set_num_threads(settings.torch_threads)
    runner = EncoderRunner(settings.model)
    identity = model_identity(settings, runner.weights_digest)
    transport = Transport(transfer_config(settings, "encoder"), identity, produce=True, consume=False)
    cache, store = _cache(settings, runner, identity)
    return ReferenceEncoder(
        runner,
        transport,
        max_running=settings.max_running,
        file_root=settings.file_root,
        cache=cache,
        store=store,
        batch_items=settings.encode_batch_items,
    )


def _cache(
    settings: EncoderBackendSettings, runner: EncoderRunner, identity: service_info_pb2.ModelIdentity
) -> tuple[EncoderCache | None, MooncakeStoreClient | None]:
    """The encoder-output cache: local LRU, in front of Mooncake Store when a master is configured."""
    if settings.cache_mib <= 0:
        return None, None
    namespace = Namespace(
        identity.model_id,
        identity.revision,
        identity.weights_digest,
        dtype_name(runner.dtype),
        preprocessing=runner.preprocessing_digest,
    )
    # The store reaches this client's staging memory at our own address (a pod's, in Kubernetes).
    store = (
        MooncakeStoreClient(StoreConfig(settings.cache_master, local_hostname=settings.host))
        if settings.cache_master
        else None
    )
    config = CacheConfig(local_max_bytes=settings.cache_mib << 20)
    return EncoderCache(namespace, store=store, config=config, specs=runner.specs), store
