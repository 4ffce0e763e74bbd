"""A minimal authoritative DNS server (UDP) for the multi-host tests: A records from a JSON zone
file ({"name": ["10.77.0.12", ...]}) re-read on every query, so a test changes membership by
rewriting the file, as Kubernetes changes a headless Service's records. AAAA queries for a known
name get an empty answer, unknown names NXDOMAIN. One question per query; TTL 1 s.

    ip netns exec NS python -m tests.multihost.dns 10.77.0.11 zone.json
"""

from __future__ import annotations

import ipaddress
import json
import socket
import struct
import sys
from pathlib import Path

TYPE_A, CLASS_IN = 1, 1


def _question(packet: bytes) -> tuple[str, int, int]:
    """(name, type, end offset of the question)."""
    labels, at = [], 12
    while packet[at]:
        length = packet[at]
        labels.append(packet[at + 1 : at + 1 + length].decode("ascii").lower())
        at += 1 + length
    qtype, _qclass = struct.unpack("!HH", packet[at + 1 : at + 5])
    return ".".join(labels), qtype, at + 5


def answer(packet: bytes, zone: dict[str, list[str]]) -> bytes:
    (query_id,) = struct.unpack("!H", packet[:2])
    name, qtype, end = _question(packet)
    records = zone.get(name.rstrip("."))
    rcode = 3 if records is None else 0  # NXDOMAIN
    answers = [ip for ip in records or [] if qtype == TYPE_A]
    header = struct.pack("!HHHHHH", query_id, 0x8400 | 0x0100 | rcode, 1, len(answers), 0, 0)  # QR AA RD
    body = b"".join(
        struct.pack("!HHHIH", 0xC00C, TYPE_A, CLASS_IN, 1, 4) + ipaddress.IPv4Address(ip).packed for ip in answers
    )
    return header + packet[12:end] + body


def serve(address: str, zone_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind((address, 53))
        print(f"dns listening on {address}:53", flush=True)
        while True:
            packet, peer = sock.recvfrom(512)
            try:
                zone = {k.lower(): v for k, v in json.loads(zone_path.read_text()).items()}
                sock.sendto(answer(packet, zone), peer)
            except (ValueError, IndexError, OSError) as exc:
                print(f"dns: bad query from {peer}: {exc}", flush=True)


if __name__ == "__main__":
    serve(sys.argv[1], Path(sys.argv[2]))
