"""Encode dispatch: the media items of a request to encoders, concurrently, and the
metadata-only messages that result.

Per item: the content hash (when the shared store or the placement among several encoders needs
it) and the encoder `EncoderPool` places it on (the one already holding or encoding it, else a
load-bounded rendezvous choice). The items placed on one encoder go in one `Encode` call (one
call per item with a shared store), with the first-contact check, through `Failover` with the
encode retries (services/router/policy.py: one retry on another encoder, the call's items
together; the drain wait for a stage that is going away). An item in the shared store the encoder
loads from goes as a CACHED_ONLY job, so no encoder computes it; an entry gone since the lookup is
computed by the same encoder on the next try. The answer's handle names the encoder's incarnation:
re-checked, an encoder gone since it answered took the embedding along, which is retried as a
failed encode. Every embedding a request gets is held by its `RequestState` (released by the
router when the request ends without prefill acking it), whether or not its siblings succeed.
"""

from __future__ import annotations

import asyncio
import re

import grpc
import structlog
from opentelemetry import metrics, trace

from libs.contract.epd.v1 import chat_pb2, encoder_pb2, generate_pb2, layout_pb2, media_pb2, tensor_pb2
from libs.contract.errors import FailedPrecondition, InvalidArgument, Unavailable
from libs.contract.validation import Limits
from libs.telemetry.stages import phase
from services.router.cache_lookup import CacheLookup, item_hash
from services.router.encoders import EncoderPool
from services.router.failover import Failover, MemberGone, TryAgain
from services.router.held import HeldPlan
from services.router.leases import Leases, RequestState
from services.router.policy import ENCODE_RETRIES, RpcFailed
from services.router.stages import StageClients

_log = structlog.get_logger(__name__)


class EncodeDispatch:
    """Places and runs the encode jobs of requests (one event loop)."""

    def __init__(
        self, clients: StageClients, encoders: EncoderPool, leases: Leases, cache: CacheLookup, limits: Limits
    ) -> None:
        self._clients = clients
        self._checks = clients.stubs.checks
        self._encoders = encoders
        self._leases = leases
        self._cache = cache
        self._limits = limits
        self._skipped = metrics.get_meter("epd").create_counter(
            "epd.router.encodes_skipped",
            description="Media items sent as held in the member's prefix cache, not encoded, by modality",
        )

    async def encode_all(
        self,
        request: generate_pb2.GenerateRequest,
        state: RequestState,
        deadline: float | None,
        held: HeldPlan | None = None,
    ) -> list[chat_pb2.ChatMessage]:
        """The request's messages with each `media` part replaced by its `encoded` part, in place;
        an item `held` by the member the request goes to is only its layout (`prefix_held`), and
        no encoder sees it."""
        messages = [chat_pb2.ChatMessage(role=src.role) for src in request.messages]
        slots: list[chat_pb2.ContentPart] = []
        media: list[chat_pb2.ContentPart] = []
        for src, dst in zip(request.messages, messages, strict=True):
            for part in src.parts:
                out = dst.parts.add()
                if part.WhichOneof("kind") == "media":
                    media.append(part)
                    slots.append(out)
                else:
                    out.CopyFrom(part)
        layouts = held.layouts if held else {}
        for index, layout in layouts.items():
            slots[index].encoded.layout.CopyFrom(layout)
            slots[index].encoded.prefix_held = True
            self._skipped.add(1, {"epd.modality": media_pb2.Modality.Name(layout.modality)})
        todo = [(index, part) for index, part in enumerate(media) if index not in layouts]
        if layouts:
            trace.get_current_span().set_attribute("epd.encode.held_items", len(layouts))
        if todo:
            with phase("epd.encode", **{"epd.items": len(todo)}):
                jobs = await self._jobs(todo)
                results = await asyncio.gather(
                    *(self._encode(state, items, deadline, placed) for placed, items in jobs), return_exceptions=True
                )
            for group in results:  # held first, so a sibling's failure still releases them
                if not isinstance(group, BaseException):
                    for item in group:
                        state.hold(item.embeddings)
            for group in results:
                if isinstance(group, BaseException):
                    raise group
            encoded = [item for group in results if not isinstance(group, BaseException) for item in group]
            order = [index for _, items in jobs for index, _, _ in items]
            for index, item in zip(order, encoded, strict=True):
                slots[index].encoded.CopyFrom(item)
        return messages

    async def encode_item(
        self, state: RequestState, part: chat_pb2.ContentPart, deadline: float | None
    ) -> layout_pb2.EncodedMedia:
        """Encode one media part (item 0 of its request), its embedding held by `state`."""
        with phase("epd.encode", **{"epd.items": 1}):
            (encoded,) = await self._encode(state, [(0, part, await self._key(part))], deadline)
        state.hold(encoded.embeddings)
        return encoded

    async def _jobs(self, media: list[tuple[int, chat_pb2.ContentPart]]) -> list[tuple[str | None, list[_Item]]]:
        """The request's encode jobs: (the encoder placed on, None: placed per try; its items).

        With a shared store, one job per item (each is looked up, and may load, on its own).
        Without one, each item is placed as it would be alone, and the items placed on one
        encoder go in one call: one RPC, started together in one batch (a call per item ran the
        first alone and queued the others behind it; on a vLLM encoder, one vLLM request each)."""
        keys = await asyncio.gather(*(self._key(part) for _, part in media))
        items = [(index, part, key) for (index, part), key in zip(media, keys, strict=True)]
        if self._cache.store is not None or len(items) == 1:
            return [(None, [item]) for item in items]
        groups: dict[str, list[_Item]] = {}
        try:
            for item in items:  # placed as if each were a call already sent: the spread is the same
                address = self._encoders.pick(key=item[2])
                if item[2] is not None:
                    self._encoders.remember(item[2], address)  # the same content again follows it
                self._encoders.begin(address)
                groups.setdefault(address, []).append(item)
        finally:
            for address, placed in groups.items():
                for _ in placed:
                    self._encoders.end(address)
        return list(groups.items())

    async def _encode(
        self, state: RequestState, items: list[_Item], deadline: float | None, placed: str | None = None
    ) -> list[layout_pb2.EncodedMedia]:
        """One `Encode` call for `items` (request index, part, content hash), on `placed` first when
        given, moved to another encoder as a whole when it fails there. One item alone may go as a
        CACHED_ONLY job (`cached_here`)."""
        job = self._job(state, items)
        indices = [index for index, _, _ in items]
        keys = [key for _, _, key in items if key is not None]
        lone_key = items[0][2] if len(items) == 1 else None
        computing = False  # once a CACHED_ONLY job found nothing, the item is computed on any retry

        def place(tried: set[str]) -> str:
            nonlocal placed
            address = placed if placed is not None else self._encoders.pick(exclude=tried, key=lone_key)
            placed = None  # a retry goes where the pool says
            for key in keys:
                self._encoders.remember(key, address)  # concurrent requests for the item follow it here
            return address

        async def cached_here(address: str) -> bool:
            return not computing and await self._in_shared_store(address, lone_key)

        async def on(address: str) -> list[layout_pb2.EncodedMedia]:
            nonlocal computing
            try:
                reply = await self._clients.encode_on(
                    address, job, state.priority, lambda: cached_here(address), deadline
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND and job.cache_policy == encoder_pb2.CACHE_POLICY_CACHED_ONLY:
                    # Evicted, rejected as invalid or unreachable since our lookup: the same encoder
                    # computes it (its single-flight still joins concurrent requests).
                    _log.info("cached item gone before its load; computing", encoder=address)
                    computing = True
                    raise TryAgain from None
                raise
            return await self._checked(address, indices, reply)

        # The first-contact check runs in the try, inside its span (`StageClients.encode_on`).
        encoders = Failover(self._encoders, "encode", ENCODE_RETRIES, deadline, None, pick=place)
        try:
            return await encoders.unary(on)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                # The encoder names the field within its own call: items[k].media.X.
                raise _invalid_item(exc.details() or "", indices) from None
            raise RpcFailed.of("encode", exc) from None

    def _job(self, state: RequestState, items: list[_Item]) -> encoder_pb2.EncodeRequest:
        job = encoder_pb2.EncodeRequest(
            request_id=state.request_id, accepted_transports=[tensor_pb2.TRANSPORT_KIND_NIXL]
        )
        for index, part, _ in items:
            # CopyFrom into the added item, not `EncodeItem(media=...)` in the constructor: upb copies
            # the media far faster this way.
            job.items.add(item_index=index).media.CopyFrom(part.media)
        return job

    async def _key(self, part: chat_pb2.ContentPart) -> str | None:
        """The item's content hash, when the shared-store lookup or placement among encoders needs
        it: with neither, hashing is pure router overhead."""
        if self._cache.store is None and self._encoders.size <= 1:
            return None
        return await item_hash(part.media, self._limits.max_inline_media_bytes)

    async def _in_shared_store(self, address: str, key: str | None) -> bool:
        """Whether the item is in the shared store of an encoder that can serve it from there."""
        if key is None:
            return False
        info = self._checks.encoder_cache(address)
        if info is None or not info.shared_store:
            return False
        return await self._cache.cached(f"{info.key_prefix}/{key}")

    async def _checked(
        self, address: str, indices: list[int], reply: encoder_pb2.EncodeResponse
    ) -> list[layout_pb2.EncodedMedia]:
        """The answer's items, its encoder re-checked: it may have restarted since we checked it."""
        if [item.layout.item_index for item in reply.items] != indices:
            raise RpcFailed.here("encode", grpc.StatusCode.INTERNAL, f"encoder {address} answered for other items")
        encoded = list(reply.items)
        instance_id = encoded[0].embeddings.agent.instance_id  # one call, one encoder incarnation
        if instance_id:
            try:
                await self._checks.encoder(address, instance_id)
            except FailedPrecondition:
                await self._release(address, encoded)
                raise
            except Unavailable as exc:
                # Gone since it answered (killed, restarting): the embeddings went with it, so this
                # is an encode that failed, retried elsewhere like one.
                await self._release(address, encoded)
                raise MemberGone from exc
        return encoded

    async def _release(self, address: str, encoded: list[layout_pb2.EncodedMedia]) -> None:
        for item in encoded:
            await self._leases.release_one(address, item.embeddings.lease_id)


_Item = tuple[int, chat_pb2.ContentPart, str | None]  # request index, media part, content hash


def _invalid_item(details: str, indices: list[int]) -> InvalidArgument:
    """The encoder's INVALID_ARGUMENT, `items[k]` of its call named as the request's media item
    (the call's items, when the encoder named none of them)."""
    found = re.match(r"items\[(\d+)\]", details)
    if found is not None and int(found.group(1)) < len(indices):
        return InvalidArgument(f"media item {indices[int(found.group(1))]}", details)
    if len(indices) == 1:
        return InvalidArgument(f"media item {indices[0]}", details)
    return InvalidArgument(f"media items {', '.join(map(str, indices))}", details)
