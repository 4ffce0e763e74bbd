"""A process's pool of tensor memory: one mmap region and an allocator of slots in it.

The region is mapped and committed once, at start-up, and `TransferAgent` registers it with NIXL
once; every tensor a process produces or receives lives in a slot of it, so no transfer ever needs
a registration. Called from any thread of the owning process (the allocator takes a lock).

Why a private anonymous mapping and not a shared-memory file: UCX reads peers' memory with
cross-memory attach (process_vm_readv), which needs no shared mapping, and private anonymous memory
can be backed by transparent huge pages (shmem THP is off on typical hosts); huge pages make UCX's
cross-memory-attach reads faster (fewer page walks; docs/results/transfer.md).

Shared pools (`shared=True`): the region is a memfd mapped MAP_SHARED instead, so another process
of the same user can map the very same pages (`share_path`, `/proc/<pid>/fd/<n>`: gone with this
process, nothing to clean up after a crash) and write tensors into slots this process allocated
(vLLM's encoder worker: libs/backends/vllm/ec_producer.py). Shmem gets no transparent huge pages
on typical hosts, so only the pools that need a second writer are shared.

Slot lifecycle: `allocate` -> in use -> `free` (back to the pool), or -> `quarantine` (a READ into
it may still be landing) -> `release_quarantined`. A slot is never handed out twice; allocation
failure is `PoolExhausted`, never an overwrite.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import dataclasses
import mmap
import os
import threading

from libs.transfer.errors import PoolExhausted

# Slot start and size granularity, bytes: a multiple of every dtype size and of a cache line.
SLOT_ALIGNMENT = 256
# Byte written over freed slots when poisoning is on.
POISON_BYTE = 0xA5
# Linux MADV_POPULATE_WRITE (5.14+): commit the pages now; Python 3.11's mmap lacks the constant.
_MADV_POPULATE_WRITE = 23
_PAGE = mmap.PAGESIZE


def align_up(n: int, alignment: int = SLOT_ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


@dataclasses.dataclass(frozen=True)
class Slot:
    """A range of the pool. `length` is the usable size (the request rounded up)."""

    offset: int
    length: int
    address: int


@dataclasses.dataclass(frozen=True)
class PoolStats:
    """A snapshot of the pool, for metrics and for tests that assert "back to empty"."""

    capacity_bytes: int
    slots_in_use: int
    bytes_in_use: int
    quarantined_slots: int
    quarantined_bytes: int
    free_bytes: int
    largest_free_bytes: int

    @property
    def empty(self) -> bool:
        return self.slots_in_use == 0 and self.quarantined_slots == 0


class MemoryPool:
    """First-fit allocator with coalescing over one committed mmap region."""

    def __init__(self, nbytes: int, *, huge_pages: bool = True, shared: bool = False) -> None:
        if nbytes <= 0:
            raise ValueError(f"pool size must be > 0, got {nbytes}")
        self.capacity = align_up(nbytes, _PAGE)
        self._fd: int | None = None
        if shared:
            self._fd = os.memfd_create("epd-pool", os.MFD_CLOEXEC)
            os.ftruncate(self._fd, self.capacity)
            self._map = mmap.mmap(self._fd, self.capacity, flags=mmap.MAP_SHARED)
        else:
            self._map = mmap.mmap(-1, self.capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge_pages and not shared:
            with contextlib.suppress(OSError):  # THP unavailable: slower reads, same behaviour
                self._map.madvise(mmap.MADV_HUGEPAGE)
        _commit(self._map, self.capacity)
        self._anchor = ctypes.c_char.from_buffer(self._map)
        self.base_address = ctypes.addressof(self._anchor)
        self._lock = threading.Lock()
        self._free_offsets: list[int] = [0]
        self._free_lengths: dict[int, int] = {0: self.capacity}
        self._in_use: dict[int, Slot] = {}
        self._quarantined: dict[int, Slot] = {}
        self._closed = False

    @property
    def share_path(self) -> str | None:
        """Where another process of this user opens the region (shared pools; None otherwise)."""
        return None if self._fd is None else f"/proc/{os.getpid()}/fd/{self._fd}"

    @property
    def buffer(self) -> mmap.mmap:
        """The mapped region (a writable buffer; `torch.frombuffer` views it without copying)."""
        return self._map

    def allocate(self, nbytes: int) -> Slot:
        """Reserve a slot of at least `nbytes` bytes; `PoolExhausted` when none is free."""
        length = align_up(max(nbytes, 1))
        with self._lock:
            for i, offset in enumerate(self._free_offsets):
                free = self._free_lengths[offset]
                if free < length:
                    continue
                del self._free_lengths[offset]
                if free == length:
                    del self._free_offsets[i]
                else:
                    self._free_offsets[i] = offset + length
                    self._free_lengths[offset + length] = free - length
                slot = Slot(offset=offset, length=length, address=self.base_address + offset)
                self._in_use[offset] = slot
                return slot
            largest = max(self._free_lengths.values(), default=0)
        raise PoolExhausted(
            f"transfer pool exhausted: {nbytes} bytes requested, largest free range {largest} of {self.capacity} bytes"
        )

    def free(self, slot: Slot, *, poison: bool = False) -> None:
        """Return an in-use slot to the pool. Freeing a slot twice is a bug and raises."""
        with self._lock:
            if self._in_use.pop(slot.offset, None) is None:
                raise ValueError(f"slot at offset {slot.offset} is not in use")
            self._give_back(slot, poison)

    def quarantine(self, slot: Slot) -> None:
        """Keep an in-use slot out of the pool until `release_quarantined`."""
        with self._lock:
            if self._in_use.pop(slot.offset, None) is None:
                raise ValueError(f"slot at offset {slot.offset} is not in use")
            self._quarantined[slot.offset] = slot

    def release_quarantined(self, slot: Slot, *, poison: bool = False) -> None:
        with self._lock:
            if self._quarantined.pop(slot.offset, None) is None:
                raise ValueError(f"slot at offset {slot.offset} is not quarantined")
            self._give_back(slot, poison)

    def view(self, slot: Slot) -> memoryview:
        """The slot's bytes, writable, without a copy."""
        return memoryview(self._map)[slot.offset : slot.offset + slot.length]

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(
                capacity_bytes=self.capacity,
                slots_in_use=len(self._in_use),
                bytes_in_use=sum(s.length for s in self._in_use.values()),
                quarantined_slots=len(self._quarantined),
                quarantined_bytes=sum(s.length for s in self._quarantined.values()),
                free_bytes=sum(self._free_lengths.values()),
                largest_free_bytes=max(self._free_lengths.values(), default=0),
            )

    def close(self) -> None:
        """Unmap the region. If tensors still view it, the mapping lives on until they are gone."""
        if self._closed:
            return
        self._closed = True
        del self._anchor
        # Exported views (tensors) keep the mapping alive; the GC unmaps it with the last one.
        with contextlib.suppress(BufferError):
            self._map.close()
        if self._fd is not None:  # the mapping (ours, a peer's) keeps the memory until unmapped
            os.close(self._fd)
            self._fd = None

    def _give_back(self, slot: Slot, poison: bool) -> None:
        # Caller holds the lock.
        if poison:
            ctypes.memset(slot.address, POISON_BYTE, slot.length)
        offset, length = slot.offset, slot.length
        i = bisect.bisect_left(self._free_offsets, offset)
        if i < len(self._free_offsets) and self._free_offsets[i] == offset + length:
            length += self._free_lengths.pop(self._free_offsets.pop(i))
        if i > 0:
            before = self._free_offsets[i - 1]
            if before + self._free_lengths[before] == offset:
                self._free_lengths[before] += length
                return
        self._free_offsets.insert(i, offset)
        self._free_lengths[offset] = length


def _commit(region: mmap.mmap, size: int) -> None:
    """Fault every page in now, so neither a READ nor a producer's first write pays for it."""
    try:
        region.madvise(_MADV_POPULATE_WRITE)
        return
    except OSError:
        pass  # kernel before 5.14: touch one byte per page instead
    for offset in range(0, size, _PAGE):
        region[offset] = 0
