"""First contact before traffic: the router sends one tiny image request through every encoder and
the prefill/decode (or PD) backend when it starts, so that no client request pays for first-contact
work: the peer handshakes (`GetServiceInfo`), HTTP/2 connections, each consumer's NIXL metadata
exchange and connection to each producer (encoder -> prefill/PD, prefill -> decode; ~25-100 ms on
the first READ), and the first run of each code path. Bounded in time; a backend that is not up
or refuses is logged and skipped (the request path handles it as before)."""

from __future__ import annotations

import struct
import zlib


def tiny_png(width: int = 64, height: int = 64) -> bytes:
    """A mid-grey RGB PNG, built with zlib alone (the router imports no image library)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\0" + b"\x80" * (3 * width) for _ in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")
