"""A service's tensor-byte counter read across namespaces (from the client's: the host's own
namespace cannot reach the others)."""

from __future__ import annotations

import re
import sys

from tests.support.netns import Topology

_FETCH = (
    "import sys, urllib.request as u; "
    "print(u.build_opener(u.ProxyHandler({})).open(sys.argv[1], timeout=10).read().decode())"
)


def transferred_bytes(topology: Topology, host: str, port: int, *, client: str = "client") -> float:
    """Tensor bytes `host` read from producers over NIXL (its `epd.transfer.bytes` counter)."""
    url = f"http://{topology.address(host)}:{port}/metrics"
    reply = topology.exec(client, sys.executable, "-c", _FETCH, url, timeout=30)
    assert reply.returncode == 0, f"metrics of {host}: {reply.stderr[-500:]}"
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in reply.stdout.splitlines()
        if re.match(r"epd_transfer_bytes\w*_total\{", line) and 'epd_transfer_transport="nixl"' in line
    )
