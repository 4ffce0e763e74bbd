"""MemoryPool: slot allocation, coalescing, quarantine, poisoning, exhaustion (no NIXL involved)."""

from __future__ import annotations

import itertools
import random
import threading
from collections.abc import Iterator

import grpc
import pytest

from libs.transfer import PoolExhausted
from libs.transfer.leases import Completion, Lease, LeaseTable
from libs.transfer.pool import POISON_BYTE, SLOT_ALIGNMENT, MemoryPool, Slot

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

KiB = 1 << 10


@pytest.fixture
def pool() -> Iterator[MemoryPool]:
    p = MemoryPool(64 * KiB, huge_pages=False)
    yield p
    p.close()


def test_slots_are_aligned_disjoint_and_inside_the_region(pool: MemoryPool) -> None:
    slots = [pool.allocate(n) for n in (1, 300, 4096, 1000)]
    for slot in slots:
        assert slot.offset % SLOT_ALIGNMENT == 0
        assert slot.address == pool.base_address + slot.offset
        assert slot.offset + slot.length <= pool.capacity
    ranges = sorted((s.offset, s.offset + s.length) for s in slots)
    assert all(end <= next_start for (_, end), (next_start, _) in itertools.pairwise(ranges))
    assert pool.stats().slots_in_use == 4


def test_exhaustion_is_a_typed_error_and_nothing_is_overwritten(pool: MemoryPool) -> None:
    held = pool.allocate(60 * KiB)
    pool.view(held)[:] = b"\x07" * held.length
    with pytest.raises(PoolExhausted) as info:
        pool.allocate(8 * KiB)
    assert info.value.grpc_code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert bytes(pool.view(held)) == b"\x07" * held.length
    assert pool.stats().slots_in_use == 1


def test_freed_neighbours_coalesce_back_into_one_range(pool: MemoryPool) -> None:
    a, b, c = (pool.allocate(16 * KiB) for _ in range(3))
    for slot in (b, a, c):  # middle first: both merges happen
        pool.free(slot)
    stats = pool.stats()
    assert stats.empty
    assert stats.largest_free_bytes == pool.capacity
    assert pool.allocate(64 * KiB).length == 64 * KiB


def test_double_free_is_refused(pool: MemoryPool) -> None:
    slot = pool.allocate(KiB)
    pool.free(slot)
    with pytest.raises(ValueError):
        pool.free(slot)


def test_quarantined_slot_stays_out_of_the_pool_until_released(pool: MemoryPool) -> None:
    slot = pool.allocate(64 * KiB)
    pool.quarantine(slot)
    stats = pool.stats()
    assert (stats.slots_in_use, stats.quarantined_slots, stats.quarantined_bytes) == (0, 1, 64 * KiB)
    assert not stats.empty
    with pytest.raises(PoolExhausted):
        pool.allocate(KiB)
    pool.release_quarantined(slot)
    assert pool.stats().empty
    assert pool.allocate(64 * KiB).offset == 0


def test_poisoned_free_overwrites_the_slot(pool: MemoryPool) -> None:
    slot = pool.allocate(KiB)
    pool.view(slot)[:] = bytes(range(256)) * 4
    pool.free(slot, poison=True)
    assert bytes(pool.buffer[slot.offset : slot.offset + slot.length]) == bytes([POISON_BYTE]) * slot.length


def test_concurrent_allocations_never_overlap() -> None:
    pool = MemoryPool(4 << 20, huge_pages=False)
    owners: dict[int, int] = {}
    lock = threading.Lock()
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        mine = []
        for _ in range(300):
            if mine and rng.random() < 0.5:
                slot = mine.pop(rng.randrange(len(mine)))
                with lock:
                    for page in range(slot.offset, slot.offset + slot.length, SLOT_ALIGNMENT):
                        del owners[page]
                pool.free(slot)
                continue
            try:
                slot = pool.allocate(rng.randrange(1, 64 * KiB))
            except PoolExhausted:
                continue
            with lock:
                for page in range(slot.offset, slot.offset + slot.length, SLOT_ALIGNMENT):
                    if page in owners:
                        errors.append(f"offset {page} handed to {seed} while owned by {owners[page]}")
                    owners[page] = seed
            mine.append(slot)
        for slot in mine:
            with lock:
                for page in range(slot.offset, slot.offset + slot.length, SLOT_ALIGNMENT):
                    del owners[page]
            pool.free(slot)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert pool.stats().empty
    assert pool.stats().largest_free_bytes == pool.capacity
    pool.close()


class _GatedPool(MemoryPool):
    """A pool whose `free` waits for a gate: the window in which a lease is gone but its slot is not."""

    def __init__(self) -> None:
        super().__init__(64 * KiB, huge_pages=False)
        self.freeing = threading.Event()
        self.gate = threading.Event()

    def free(self, slot: Slot, *, poison: bool = False) -> None:
        self.freeing.set()
        assert self.gate.wait(10)
        super().free(slot, poison=poison)


@pytest.mark.parametrize("how", ["expiry", "ack"])
def test_lease_stats_never_show_a_lease_gone_while_its_slot_is_in_use(how: str) -> None:
    pool = _GatedPool()
    table = LeaseTable(pool, poison_freed=False)
    table.add(Lease("lease-1", pool.allocate(4 * KiB), expires_at=0.0))
    completer = threading.Thread(
        target=lambda: table.reap(now=1.0) if how == "expiry" else table.complete("lease-1", Completion.ACKED)
    )
    completer.start()
    assert pool.freeing.wait(10)
    seen: list[tuple[int, int]] = []
    reader = threading.Thread(target=lambda: seen.append((table.stats().active, pool.stats().slots_in_use)))
    reader.start()
    reader.join(0.2)  # the completion holds the table: a reader waits instead of seeing half of it
    pool.gate.set()
    completer.join(10)
    reader.join(10)
    assert seen == [(0, 0)]
    pool.close()
