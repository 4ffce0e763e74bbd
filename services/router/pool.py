"""A pool of interchangeable backends of one stage (encoders, prefills, decodes, PDs) and the
choice of one per call.

- `pick` takes the member with the fewest outstanding calls, round robin on ties, among members
  that are not draining (a draining one is still picked when no other is left) and not excluded
  (those one request already tried).
- Members change while the router runs (`update`, from services/router/membership.py): a new
  member is a candidate at once; a departed one is never picked again, and its calls in flight
  finish and are counted until they end (`begin` / `end`).
- `draining(address)`: the member refused work because it drains (it is leaving): avoided until
  membership drops it or the period passes.
- `pick_affine(key)`: the member a key (a conversation) belongs to, so that a conversation's turns
  meet the prefix its earlier turns left in that member's cache: the member its last turn went to
  (remembered for the latest `HOMES` keys); the least loaded for a new key, and instead of its
  member while that member is busier than `AFFINITY_LOAD` times the least loaded (bounded load),
  draining, excluded or gone. (A hash of the key would place new conversations without memory,
  but unevenly when they are few: 7 of 8 on one of two members happened.)

`EncoderPool` (services/router/encoders.py) adds content-hash placement on top.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Sequence

from libs.contract.errors import Unavailable

# A conversation's member keeps it while its calls in flight are at most this many times the least
# loaded member's, plus one: affinity bends the balance this far and no further.
AFFINITY_LOAD = 1.5
HOMES = 65536  # conversations whose last member is remembered (~100 bytes each)


class MemberPool:
    """Addresses of one stage's members with their outstanding calls (use from one event loop)."""

    def __init__(self, addresses: Sequence[str], *, stage: str = "backend", dynamic: bool = False) -> None:
        if not addresses and not dynamic:
            raise ValueError(f"at least one {stage} address is needed")
        self.stage = stage
        self.outstanding = dict.fromkeys(addresses, 0)  # members -> calls in flight
        self._departed: dict[str, int] = {}  # former members -> their calls still in flight
        self._finished: list[str] = []  # former members whose last call ended since the last update
        self._draining: dict[str, float] = {}  # member -> monotonic time until which it is not picked
        self._order = itertools.count()
        self._last_pick = dict.fromkeys(addresses, -1)
        self._homes: OrderedDict[bytes, str] = OrderedDict()  # conversation key -> its last member

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
        """A call was sent to `address` (picked just now, so a member)."""
        self.outstanding[address] += 1

    def end(self, address: str) -> None:
        """A call at `address` ended, whether or not it is still a member."""
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
            until = time.monotonic() + for_s
            self._draining[address] = max(until, self._draining.get(address, until))

    def candidates(self, exclude: set[str]) -> list[str]:
        """Members that may be picked: not excluded, and not draining while another is left."""
        candidates = [a for a in self.outstanding if a not in exclude]
        if self._draining:
            now = time.monotonic()
            self._draining = {a: t for a, t in self._draining.items() if t > now and a in self.outstanding}
            candidates = [a for a in candidates if a not in self._draining] or candidates
        if not candidates:
            raise Unavailable(f"no {self.stage} left to try")
        return candidates

    def untried(self, tried: set[str]) -> bool:
        """Whether a member outside `tried` is left (another one to retry on)."""
        return any(a not in tried for a in self.outstanding)

    def least_loaded(self, candidates: Sequence[str]) -> str:
        """The candidate with the fewest outstanding calls, round robin on ties."""
        address = min(candidates, key=lambda a: (self.outstanding[a], self._last_pick[a]))
        self._last_pick[address] = next(self._order)
        return address

    def pick(self, exclude: set[str] = frozenset()) -> str:  # type: ignore[assignment]
        """The member for the next call, never one in `exclude`."""
        return self.least_loaded(self.candidates(exclude))

    def last(self, key: bytes) -> str | None:
        """The member `key`'s last call went to, while it is a member (changes nothing)."""
        owner = self._homes.get(key)
        return owner if owner in self.outstanding else None

    def _within_bound(self, owner: str, candidates: Sequence[str]) -> bool:
        """Whether `owner` may keep its conversations (bounded load): its calls in flight at most
        `AFFINITY_LOAD` times the least loaded candidate's, plus one."""
        return self.outstanding[owner] <= AFFINITY_LOAD * min(self.outstanding[a] for a in candidates) + 1

    def pick_affine(self, key: bytes, exclude: set[str] = frozenset()) -> str:  # type: ignore[assignment]
        """The member `key` belongs to among the candidates, unless it is overloaded (then the least
        loaded); never one in `exclude`."""
        candidates = self.candidates(exclude)
        owner = self._homes.get(key)
        if owner not in candidates or not self._within_bound(owner, candidates):
            # A new conversation (or one its member cannot keep): the least loaded, round robin on
            # ties, so conversations spread evenly however few there are.
            owner = self.least_loaded(candidates)
        else:
            self._last_pick[owner] = next(self._order)
        self._homes[key] = owner
        self._homes.move_to_end(key)
        if len(self._homes) > HOMES:
            self._homes.popitem(last=False)
        return owner
