"""Several hosts on one machine: network namespaces joined by veth pairs and a bridge.

`Topology(["router", "encoder-0", ...])` creates, for a run of this process:
- a "switch" namespace holding a bridge;
- per host a namespace with loopback up and `eth0` (one end of a veth pair; the other end sits on
  the bridge in the switch namespace) with its own address in 10.77.0.0/24.
Every interface is created inside our own namespaces (none in the host's), so deleting the
namespaces removes every veth and the bridge with them; `close()` does that and checks that none
is left. Names carry this process's PID: leftovers of a killed run are removed by the next run
(`remove_stale`). Needs root (CAP_SYS_ADMIN); without it `Topology` raises NamespacesUnavailable.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import secrets
import subprocess
from pathlib import Path

PREFIX = "epdt"
SUBNET = "10.77.0"
CLONE_NEWNET = 0x40000000
NETNS_DIR = Path("/var/run/netns")


class NamespacesUnavailable(RuntimeError):
    """Network namespaces cannot be created here (not root, or no iproute2)."""


def _ip(*args: str) -> str:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise subprocess.CalledProcessError(result.returncode, ["ip", *args], result.stdout, result.stderr)
    return result.stdout


def namespaces() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]


def remove_stale() -> list[str]:
    """Delete our namespaces whose creating process is gone (a killed earlier run)."""
    removed = []
    for name in namespaces():
        match = re.match(rf"^{PREFIX}(\d+)-", name)
        if match and not Path(f"/proc/{match.group(1)}").exists():
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("netns", "delete", name)
                removed.append(name)
    return removed


def enter(namespace: str) -> None:
    """Move the calling thread (and the threads it creates afterwards) into `namespace`."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(NETNS_DIR / namespace, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns({namespace}): {os.strerror(errno)}")
    finally:
        os.close(fd)


class Topology:
    def __init__(self, hosts: list[str]) -> None:
        if len(hosts) > 200:
            raise ValueError("at most 200 hosts")
        self.run = f"{PREFIX}{os.getpid()}-{secrets.token_hex(2)}"
        self.switch = f"{self.run}-sw"
        self.hosts = {host: f"{self.run}-{host}" for host in hosts}
        self.addresses = {host: f"{SUBNET}.{i + 10}" for i, host in enumerate(hosts)}
        self._created: list[str] = []
        if os.geteuid() != 0:
            raise NamespacesUnavailable("network namespaces need root (CAP_SYS_ADMIN); this test runs as root in CI")
        remove_stale()
        try:
            self._build()
        except (subprocess.CalledProcessError, OSError) as exc:
            self.close()
            detail = getattr(exc, "stderr", "") or str(exc)
            raise NamespacesUnavailable(f"cannot build the namespaces: {detail.strip()}") from exc

    def _add(self, name: str) -> None:
        _ip("netns", "add", name)
        self._created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        self._add(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, (host, ns) in enumerate(self.hosts.items()):
            self._add(ns)
            port = f"p{i}"
            _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", port, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{self.addresses[host]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    def namespace(self, host: str) -> str:
        return self.hosts[host]

    def address(self, host: str) -> str:
        return self.addresses[host]

    def command(self, host: str, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.hosts[host], *argv]

    def exec(self, host: str, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.command(host, *argv), capture_output=True, text=True, timeout=timeout)

    def counters(self, host: str) -> dict[str, int]:
        """eth0's byte counters in `host` (what crossed the wire)."""
        base = "/sys/class/net/eth0/statistics"
        out = self.exec(host, "cat", f"{base}/tx_bytes", f"{base}/rx_bytes").stdout.split()
        return {"tx_bytes": int(out[0]), "rx_bytes": int(out[1])}

    def close(self) -> list[str]:
        """Delete every namespace we made (their veths and bridge go with them); returns what is
        still there (should be nothing)."""
        for name in reversed(self._created):
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("netns", "delete", name)
        self._created.clear()
        return [n for n in namespaces() if n.startswith(self.run)]

    def __enter__(self) -> Topology:
        return self

    def __exit__(self, *exc: object) -> None:
        left = self.close()
        assert not left, f"namespaces left behind: {left}"
