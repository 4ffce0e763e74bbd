"""What one request holds at its producers, and giving it back.

Each embedding an encoder produced and each KV cache a prefill published is a lease at its
producer until its consumer acks it (prefill reads the embeddings, decode the KV). `RequestState`
records the leases the request still holds; `Leases` releases them (`RELEASE_REASON_ABANDONED`)
when the request is done with them unread: a retry that re-encodes or recomputes, a failure, a
cancel, a deadline. `Router.generate` releases whatever is left on every exit, shielded from the
cancel that ends it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog

from libs.contract.epd.v1 import lease_pb2, prefill_pb2, tensor_pb2

_log = structlog.get_logger(__name__)


@dataclass
class RequestState:
    """What one request holds: leases to release, whether tokens were streamed."""

    request_id: str
    priority: int = 0
    leases: dict[str, set[str]] = field(default_factory=dict)  # producer address -> lease ids
    streamed: bool = False

    def hold(self, handle: tensor_pb2.TensorHandle) -> None:
        """A tensor the request now holds at the producer the handle names."""
        self.leases.setdefault(handle.agent.producer_address, set()).add(handle.lease_id)

    def hold_kv(self, kv_cache: prefill_pb2.KvCache) -> None:
        """The KV cache prefill published, held until decode acks it."""
        if kv_cache.HasField("paged"):  # contract 1.3: the KV stays in prefill's engine, a lease of its own
            paged = kv_cache.paged
            self.leases.setdefault(paged.producer_address, set()).add(paged.lease_id)
        else:
            self.hold(kv_cache.handle)  # held at the prefill that produced it (the handle names it)

    def acked(self) -> None:
        """The consumer read and acked everything the request held."""
        self.leases.clear()


class Leases:
    """Releases leases at their producers' LeaseService (`lease(address)` -> stub)."""

    def __init__(self, lease: Callable[[str], Any]) -> None:
        self._lease = lease

    async def release_all(self, state: RequestState) -> None:
        """Release every lease `state` holds (best effort: a producer gone took its memory along)."""
        held, state.leases = state.leases, {}
        for address, lease_ids in held.items():
            try:
                await self._lease(address).ReleaseLeases(
                    lease_pb2.ReleaseLeasesRequest(
                        lease_ids=sorted(lease_ids), reason=lease_pb2.RELEASE_REASON_ABANDONED
                    ),
                    timeout=2.0,
                )
            except grpc.aio.AioRpcError as exc:
                # The producer is gone (its memory with it) or will reclaim on lease expiry.
                _log.warning("lease release failed", producer=address, code=exc.code().name)

    async def release_one(self, address: str, lease_id: str) -> None:
        held = RequestState("")
        held.leases[address] = {lease_id}
        await self.release_all(held)
