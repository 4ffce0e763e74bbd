"""Which encoder gets a media item.

- An item in flight on, or recently encoded by, encoder X goes to X (`affinity`: a bounded LRU of
  content hash -> address). X's single-flight joins the running computation, or its local cache
  answers: concurrent requests carrying one new item cost one encode however many requests carry it.
- A new item goes to its rendezvous-hash choice among the encoders whose outstanding jobs are within
  `slack` of the least loaded one. Routers sharing an encoder list therefore send the same new item
  to the same encoder, so one encoder's single-flight also covers several routers, while no encoder
  takes more than `slack` jobs beyond the least loaded.
- An item the router cannot hash (a file:// URI only the encoders can read) goes to the least
  loaded encoder, round-robin on ties.
- Membership, outstanding counts and draining members are the shared `MemberPool`'s
  (services/router/pool.py), as for prefill, decode and PD pools.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from services.router.pool import MemberPool


def _weight(address: str, key: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{address}\0{key}".encode(), digest_size=8).digest(), "big")


class EncoderPool(MemberPool):
    """Encoder addresses with their outstanding jobs and the items they hold (one event loop)."""

    def __init__(
        self, addresses: Sequence[str], *, slack: int = 4, affinity_entries: int = 65536, dynamic: bool = False
    ) -> None:
        if slack < 0 or affinity_entries < 1:
            raise ValueError("slack must be >= 0 and affinity_entries >= 1")
        super().__init__(addresses, stage="encoder", dynamic=dynamic)
        self.slack = slack
        self._affinity: OrderedDict[str, str] = OrderedDict()
        self._affinity_entries = affinity_entries

    def pick(self, exclude: set[str] = frozenset(), key: str | None = None) -> str:  # type: ignore[assignment]
        """The encoder for an item with content hash `key` (None: not hashable), never one in `exclude`."""
        candidates = self.candidates(exclude)
        if key is not None:
            held = self._affinity.get(key)
            if held is not None and held in candidates:
                self._affinity.move_to_end(key)
                return held
            least = min(self.outstanding[a] for a in candidates)
            near = [a for a in candidates if self.outstanding[a] <= least + self.slack]
            return max(near, key=lambda a: _weight(a, key))
        return self.least_loaded(candidates)

    def remember(self, key: str, address: str) -> None:
        """`address` is encoding (or has encoded) the item `key`: send its next requests there."""
        self._affinity[key] = address
        self._affinity.move_to_end(key)
        while len(self._affinity) > self._affinity_entries:
            self._affinity.popitem(last=False)

    def holder(self, key: str) -> str | None:
        return self._affinity.get(key)
