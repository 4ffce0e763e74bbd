"""The router's first-contact checks of its peers, with the shared peer directory.

Before using an encoder, the router checks that it speaks our contract major, is an encoder,
serves the same model as prefill (or PD), and emits the embedding specs prefill consumes. Every
prefill, decode (or PD) member is checked likewise before its first call: the right role, the
same model, and a decode on the same engine as the prefill whose KV it reads. Results are cached
per peer incarnation: a handle naming a new `instance_id` (the encoder restarted) triggers a
re-check.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable

from libs.backends.engines import engine_of
from libs.cache.keys import CACHED_ONLY
from libs.contract.epd.v1 import service_info_pb2
from libs.contract.errors import EpdError, FailedPrecondition, Unavailable
from libs.rpc.peers import PeerChannels, check_embedding_specs, check_peer
from services.router.pool import MemberPool

ROLE = service_info_pb2


def check_engine_pair(
    prefill: service_info_pb2.ServiceInfo,
    prefill_address: str,
    decode: service_info_pb2.ServiceInfo,
    decode_address: str,
) -> None:
    """A KV cache moves only between two services of the same engine (their KV layouts differ)."""
    theirs, ours = engine_of(decode), engine_of(prefill)
    if theirs != ours:
        raise FailedPrecondition(
            f"prefill {prefill_address} runs the {ours} engine and decode {decode_address} the {theirs} engine: "
            "a KV cache moves only between services of the same engine"
        )


class PeerChecks:
    """First-contact checks of every member of the router's pools. The stack's model is the first
    prefill (or PD) member's that passes; every other member must serve the same one, and a KV
    cache moves only between a prefill and a decode of the same engine."""

    def __init__(self, peers: PeerChannels, *, prefill: MemberPool, decode: MemberPool | None) -> None:
        self._peers = peers
        self._prefill = prefill  # the prefill pool (E/P/D) or the PD pool (E+PD)
        self._decode = decode
        self._roles = [ROLE.SERVICE_ROLE_PREFILL] if decode is not None else [ROLE.SERVICE_ROLE_PREFILL_DECODE]
        self._backend: service_info_pb2.ServiceInfo | None = None
        self._lock = asyncio.Lock()

    async def _member(
        self, address: str, roles: Iterable[int], model: service_info_pb2.ModelIdentity | None
    ) -> service_info_pb2.ServiceInfo:
        info = await self._peers.info(address)
        try:
            check_peer(info, address, roles=roles, model=model)
        except FailedPrecondition:
            self._peers.forget(address)  # re-read next time: it may be replaced by a good one
            raise
        return info

    @staticmethod
    async def _first(pool: MemberPool, check: Callable[[str], Awaitable[object]]) -> str:
        """The first member of `pool` that passes `check`; else the first refusal (or unreachable)."""
        failures: list[EpdError] = []
        for address in list(pool.outstanding):
            try:
                await check(address)
                return address
            except (FailedPrecondition, Unavailable) as exc:
                failures.append(exc)
        if not failures:
            raise Unavailable(f"no {pool.stage} member (yet)")
        refused = [f for f in failures if isinstance(f, FailedPrecondition)]
        raise (refused or failures)[0]

    async def backend(self) -> service_info_pb2.ServiceInfo:
        """The model-serving side's checked info (a prefill's or PD's); at least one decode must serve
        the same model on the same engine."""
        if self._backend is not None:
            return self._backend
        async with self._lock:
            if self._backend is None:
                address = await self._first(self._prefill, lambda a: self._member(a, self._roles, None))
                info = self._peers.cached(address)
                assert info is not None
                if self._decode is not None:
                    # Checked against this prefill before it becomes the reference.
                    await self._first(self._decode, lambda a: self._decode_against(a, info, address))
                self._backend = info
        return self._backend

    @property
    def checked_backend(self) -> service_info_pb2.ServiceInfo | None:
        """The model-serving side's info once `backend()` checked it; None before first contact."""
        return self._backend

    async def _decode_against(self, address: str, prefill: service_info_pb2.ServiceInfo, prefill_address: str) -> None:
        info = await self._member(address, [ROLE.SERVICE_ROLE_DECODE], prefill.model)
        check_engine_pair(prefill, prefill_address, info, address)

    async def prefill(self, address: str) -> None:
        """Raise FailedPrecondition when the prefill (or PD) member at `address` cannot serve this stack."""
        backend = await self.backend()
        await self._member(address, self._roles, backend.model)

    async def decode(self, address: str, prefill_address: str) -> None:
        """Raise FailedPrecondition when the decode at `address` cannot read `prefill_address`'s KV."""
        backend = await self.backend()
        prefill = self._peers.cached(prefill_address)
        prefill = backend if prefill is None else prefill
        await self._decode_against(address, prefill, prefill_address)

    def encoder_cache(self, address: str) -> service_info_pb2.EncoderCacheInfo | None:
        """The (already checked) encoder's cache, when it serves CACHED_ONLY jobs."""
        info = self._peers.cached(address)
        if info is None or CACHED_ONLY not in info.capabilities or not info.HasField("encoder_cache"):
            return None
        return info.encoder_cache

    def max_running(self, address: str) -> int | None:
        """What the (already checked) peer at `address` advertises it runs at once; None unchecked."""
        info = self._peers.cached(address)
        return None if info is None else info.max_running_requests

    def honors(self, address: str, capability: str) -> bool:
        """Whether the (already checked) peer at `address` advertises `capability`."""
        info = self._peers.cached(address)
        return info is not None and capability in info.capabilities

    async def encoder(self, address: str, instance_id: str | None = None) -> None:
        """Raise FailedPrecondition when the encoder at `address` cannot feed our prefill."""
        backend = await self.backend()
        info = await self._peers.info(address, instance_id=instance_id)
        try:
            check_peer(info, address, roles=[ROLE.SERVICE_ROLE_ENCODER], model=backend.model)
            check_embedding_specs(backend.embedding_specs, info, address)
        except FailedPrecondition:
            self._peers.forget(address)  # re-read next time: it may be replaced by a good one
            raise
