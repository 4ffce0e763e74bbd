"""Producer-side bookkeeping of leases: which slots are held for which consumer, until when.

Owned by `TensorProducer`. A lease's slot returns to the pool on exactly one of: the consumer's
completion notification (`acked`), an explicit release (`LeaseService.ReleaseLeases`), or expiry
(the reaper, run by the agent's service thread). Never before: that is the slot-reuse guarantee.
Late or duplicate completions of a lease already gone are counted and ignored. The slot's lease
stamp is wiped before the slot goes back, so no handle matches it afterwards. Thread-safe.
"""

from __future__ import annotations

import dataclasses
import enum
import threading

from libs.transfer.pool import MemoryPool, Slot
from libs.transfer.stamp import wipe


class Completion(enum.Enum):
    ACKED = "acked"
    RELEASED = "released"
    EXPIRED = "expired"


@dataclasses.dataclass(frozen=True)
class Lease:
    lease_id: str
    slot: Slot
    expires_at: float  # time.monotonic() deadline


@dataclasses.dataclass(frozen=True)
class LeaseStats:
    active: int
    active_bytes: int
    acked: int
    released: int
    expired: int
    unknown_completions: int


class LeaseTable:
    def __init__(self, pool: MemoryPool, *, poison_freed: bool) -> None:
        self._pool = pool
        self._poison = poison_freed
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._counts = dict.fromkeys(Completion, 0)
        self._unknown = 0

    def add(self, lease: Lease) -> None:
        with self._lock:
            if lease.lease_id in self._leases:
                raise ValueError(f"lease {lease.lease_id} already exists")
            self._leases[lease.lease_id] = lease

    def complete(self, lease_id: str, how: Completion) -> bool:
        """Free the lease's slot; False (counted) when the lease is unknown or already gone."""
        with self._lock:
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                self._unknown += 1
                return False
            self._counts[how] += 1
            self._free(lease.slot)
        return True

    def _free(self, slot: Slot) -> None:
        # Under the lock: stats never show a lease gone while its slot is still in use.
        wipe(slot.address)
        self._pool.free(slot, poison=self._poison)

    def reap(self, now: float) -> bool:
        """Expire overdue leases; True while leases remain (the agent then polls fast)."""
        with self._lock:
            overdue = [lease for lease in self._leases.values() if lease.expires_at <= now]
            for lease in overdue:
                del self._leases[lease.lease_id]
                self._free(lease.slot)
            self._counts[Completion.EXPIRED] += len(overdue)
            return bool(self._leases)

    def stats(self) -> LeaseStats:
        with self._lock:
            return LeaseStats(
                active=len(self._leases),
                active_bytes=sum(lease.slot.length for lease in self._leases.values()),
                acked=self._counts[Completion.ACKED],
                released=self._counts[Completion.RELEASED],
                expired=self._counts[Completion.EXPIRED],
                unknown_completions=self._unknown,
            )
