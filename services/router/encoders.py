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
- Members change while the router runs (`update`, from services/router/membership.py): a new
  encoder is a candidate at once; a departed one is never picked again, and its jobs in flight
  finish and are counted until they end (`begin` / `end`).
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections import OrderedDict
from collections.abc import Sequence

from libs.contract.errors import Unavailable


def _weight(address: str, key: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{address}\0{key}".encode(), digest_size=8).digest(), "big")


class EncoderPool:
    """Encoder addresses with their outstanding jobs and the items they hold (one event loop)."""

    def __init__(
        self, addresses: Sequence[str], *, slack: int = 4, affinity_entries: int = 65536, dynamic: bool = False
    ) -> None:
        if not addresses and not dynamic:
            raise ValueError("at least one encoder address is needed")
        if slack < 0 or affinity_entries < 1:
            raise ValueError("slack must be >= 0 and affinity_entries >= 1")
        self.outstanding = dict.fromkeys(addresses, 0)  # members -> jobs in flight
        self._departed: dict[str, int] = {}  # former members -> their jobs still in flight
        self._finished: list[str] = []  # former members whose last job ended since the last update
        self._draining: dict[str, float] = {}  # member -> monotonic time until which it is not picked
        self.slack = slack
        self._affinity: OrderedDict[str, str] = OrderedDict()
        self._affinity_entries = affinity_entries
        self._order = itertools.count()
        self._last_pick = dict.fromkeys(addresses, -1)

    @property
    def size(self) -> int:
        """Current members."""
        return len(self.outstanding)

    def update(self, addresses: Sequence[str]) -> list[str]:
        """New members; returns former members with nothing in flight (their channels can go)."""
        wanted = set(addresses)
        idle, self._finished = [a for a in self._finished if a not in wanted], []
        for address in [a for a in self.outstanding if a not in wanted]:
            busy = self.outstanding.pop(address)
            self._last_pick.pop(address, None)
            if busy:
                self._departed[address] = busy
            else:
                idle.append(address)
        for address in addresses:
            if address not in self.outstanding:
                self.outstanding[address] = self._departed.pop(address, 0)  # back again: same count
                self._last_pick[address] = -1
        return idle

    def begin(self, address: str) -> None:
        """A job was sent to `address` (picked just now, so a member)."""
        self.outstanding[address] += 1

    def end(self, address: str) -> None:
        """A job at `address` ended, whether or not it is still a member."""
        if address in self.outstanding:
            self.outstanding[address] -= 1
        elif address in self._departed:
            self._departed[address] -= 1
            if not self._departed[address]:
                del self._departed[address]
                self._finished.append(address)

    def draining(self, address: str, for_s: float = 30.0) -> None:
        """`address` refused work because it drains (it is leaving): pick others while any is left,
        until membership drops it or `for_s` passes."""
        if address in self.outstanding:
            self._draining[address] = time.monotonic() + for_s

    def pick(self, exclude: set[str] = frozenset(), key: str | None = None) -> str:  # type: ignore[assignment]
        """The encoder for an item with content hash `key` (None: not hashable), never one in `exclude`."""
        candidates = [a for a in self.outstanding if a not in exclude]
        if self._draining:
            now = time.monotonic()
            self._draining = {a: t for a, t in self._draining.items() if t > now and a in self.outstanding}
            candidates = [a for a in candidates if a not in self._draining] or candidates
        if not candidates:
            raise Unavailable("no encoder left to try")
        if key is not None:
            held = self._affinity.get(key)
            if held is not None and held in candidates:
                self._affinity.move_to_end(key)
                return held
            least = min(self.outstanding[a] for a in candidates)
            near = [a for a in candidates if self.outstanding[a] <= least + self.slack]
            return max(near, key=lambda a: _weight(a, key))
        address = min(candidates, key=lambda a: (self.outstanding[a], self._last_pick[a]))
        self._last_pick[address] = next(self._order)
        return address

    def remember(self, key: str, address: str) -> None:
        """`address` is encoding (or has encoded) the item `key`: send its next requests there."""
        self._affinity[key] = address
        self._affinity.move_to_end(key)
        while len(self._affinity) > self._affinity_entries:
            self._affinity.popitem(last=False)

    def holder(self, key: str) -> str | None:
        return self._affinity.get(key)
