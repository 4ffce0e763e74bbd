"""Lease stamps: how a consumer tells a live lease from anything else without trusting the caller.

A producer that advertises `CAPABILITY` writes, in the first `STAMP_BYTES` of each slot it
publishes, a stamp naming the lease: a magic and the SHA-256 of the lease id. The tensors follow
(the handle's regions start right after it), and the stamp is wiped when the slot is freed (ack,
release, expiry), before the memory can be reused. A consumer READs the stamp with the tensors and
compares it with the handle's lease id: a handle with a made-up lease id, a lease that was
released or expired, a slot that was freed and reused for another lease, or regions that do not
point where the producer put that lease, all read a stamp that does not match - `StaleHandle`
(NOT_FOUND), however the handle's checksum fields were filled.

The stamp is read in the same READ as the tensors, not atomically with them: a lease freed during
the READ (released by the router, or expired: the consumer never starts a READ that close to
expiry) may still pass the stamp check; the CRC-32 of each tensor covers that window.
"""

from __future__ import annotations

import ctypes
import hashlib

from libs.transfer.errors import StaleHandle

CAPABILITY = "transfer.lease_stamp"
# Advertised by a producer that attaches a CRC-32 to every tensor: consumers then refuse handles
# without them (a checksum left out is not a way around the check).
CHECKSUMS_CAPABILITY = "transfer.checksums"
STAMP_BYTES = 64  # a multiple of the pool's slot alignment's divisors; tensors start right after
_MAGIC = b"EPDLEASE"


def stamp_of(lease_id: str) -> bytes:
    """The stamp bytes of a lease."""
    digest = hashlib.sha256(lease_id.encode()).digest()
    return (_MAGIC + digest).ljust(STAMP_BYTES, b"\0")


def write(buffer: memoryview, lease_id: str) -> None:
    """Stamp a slot (`buffer` is its first `STAMP_BYTES`) for `lease_id`."""
    buffer[:STAMP_BYTES] = stamp_of(lease_id)


def wipe(address: int) -> None:
    """Clear the stamp of a slot being freed (at its start address), so no handle matches it."""
    ctypes.memset(address, 0, STAMP_BYTES)


def verify(read: memoryview | bytes, lease_id: str, producer: str) -> None:
    """`StaleHandle` unless the stamp read from the producer names `lease_id`."""
    if bytes(read[:STAMP_BYTES]) != stamp_of(lease_id):
        what = "freed" if bytes(read[: len(_MAGIC)]) != _MAGIC else "stamped for another lease"
        raise StaleHandle(
            f"lease {lease_id} is not held by agent {producer}: the slot its handle names is {what} "
            "(lease released, expired or made up)"
        )
