"""The router's first-contact checks of its backends, with the shared peer directory.

Before using an encoder, the router checks that it speaks our contract major, is an encoder,
serves the same model as prefill (or PD), and emits the embedding specs prefill consumes. Prefill
and decode must serve the same model. Results are cached per peer incarnation: a handle naming a
new `instance_id` (the encoder restarted) triggers a re-check.
"""

from __future__ import annotations

import asyncio

from libs.cache.keys import CACHED_ONLY
from libs.contract.epd.v1 import service_info_pb2
from libs.contract.errors import FailedPrecondition
from libs.engines.identity import engine_of
from libs.rpc.peers import PeerDirectory, check_embedding_specs, check_peer

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


class BackendChecks:
    def __init__(self, peers: PeerDirectory, *, prefill: str, decode: str | None) -> None:
        self._peers = peers
        self._prefill = prefill
        self._decode = decode
        self._backend: service_info_pb2.ServiceInfo | None = None
        self._lock = asyncio.Lock()

    async def backend(self) -> service_info_pb2.ServiceInfo:
        """Prefill's (or PD's) checked info; decode must serve the same model."""
        if self._backend is not None:
            return self._backend
        async with self._lock:
            if self._backend is None:
                roles = [ROLE.SERVICE_ROLE_PREFILL] if self._decode else [ROLE.SERVICE_ROLE_PREFILL_DECODE]
                info = await self._peers.info(self._prefill)
                check_peer(info, self._prefill, roles=roles)
                if self._decode:
                    decode = await self._peers.info(self._decode)
                    check_peer(decode, self._decode, roles=[ROLE.SERVICE_ROLE_DECODE], model=info.model)
                    check_engine_pair(info, self._prefill, decode, self._decode)
                self._backend = info
        return self._backend

    def encoder_cache(self, address: str) -> service_info_pb2.EncoderCacheInfo | None:
        """The (already checked) encoder's cache, when it serves CACHED_ONLY jobs."""
        info = self._peers.cached(address)
        if info is None or CACHED_ONLY not in info.capabilities or not info.HasField("encoder_cache"):
            return None
        return info.encoder_cache

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
