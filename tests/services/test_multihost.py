"""Multi-host for real: router, two encoders, prefill and decode each in its own network namespace
(its own IP on a bridge, not loopback), the client in another; NIXL forced onto UCX's TCP transport
over the veths (`--ucx-tls tcp --ucx-net-devices eth0`: no shared memory, no cross-memory attach).
The router finds the encoders by DNS (`dns:///encoders.epd.test:50061`, answered by a real DNS
server in a namespace of its own). The golden requests' tokens equal the model's own generate().
The embeddings really crossed the wire: the encoders' interfaces sent at least the bytes prefill
reports having read. Every namespace (and with it every veth and the bridge) is removed at the end;
without root this fails, naming why (CI runs as root)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from libs.launch.process import ServiceProcess
from tests.multihost.metrics import transferred_bytes
from tests.support.netns import NamespacesUnavailable, Topology, namespaces
from tests.support.stacks import MIXES

pytestmark = pytest.mark.stack

HOSTS = ["client", "dns", "router", "encoder-0", "encoder-1", "prefill", "decode"]
PORTS = {"router": 50051, "encoder": 50061, "prefill": 50071, "decode": 50081}
METRICS_PORT = 9090
ENCODERS_NAME = "encoders.epd.test"
TRANSPORT = ["--ucx-tls", "tcp", "--ucx-net-devices", "eth0"]


@pytest.fixture
def topology() -> Iterator[Topology]:
    try:
        topo = Topology(HOSTS)
    except NamespacesUnavailable as exc:
        pytest.fail(f"multi-host test needs network namespaces: {exc}")
    with topo:
        yield topo
    assert not [n for n in namespaces() if n.startswith(topo.run)]


def _resolver(topology: Topology, host: str) -> Path:
    """/etc/netns/<ns>/resolv.conf: `ip netns exec` mounts it over /etc/resolv.conf for that host."""
    directory = Path("/etc/netns") / topology.namespace(host)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "resolv.conf").write_text(f"nameserver {topology.address('dns')}\noptions timeout:1 attempts:2\n")
    return directory


def _transferred_bytes(topology: Topology, host: str) -> float:
    return transferred_bytes(topology, host, METRICS_PORT)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_golden_requests_across_namespaces_over_tcp(
    topology: Topology, model_path: Path, expected: dict[str, list[int]], tmp_path: Path
) -> None:
    zone = tmp_path / "zone.json"
    zone.write_text(json.dumps({ENCODERS_NAME: [topology.address("encoder-0"), topology.address("encoder-1")]}))
    resolver = _resolver(topology, "router")
    dns = subprocess.Popen(
        [*topology.command("dns", sys.executable, "-m", "tests.multihost.dns"), topology.address("dns"), str(zone)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    model = ["--model", str(model_path), "--pool-mib", "32", *TRANSPORT, "--metrics-port", str(METRICS_PORT)]

    def service(host: str, module: str, args: list[str]) -> ServiceProcess:
        role = host.split("-")[0]
        where = ["--host", topology.address(host), "--port", str(PORTS[role])]
        return ServiceProcess(
            host, module, [*args, *where], log_path=tmp_path / f"{host}.log", netns=topology.namespace(host)
        )

    backends = [
        service(h, f"services.{h.split('-')[0]}", model) for h in ("encoder-0", "encoder-1", "prefill", "decode")
    ]
    router = service(
        "router",
        "services.router",
        [
            *("--layout", "e/p/d", "--encoders", f"dns:///{ENCODERS_NAME}:{PORTS['encoder']}"),
            *("--prefill", f"{topology.address('prefill')}:{PORTS['prefill']}"),
            *("--decode", f"{topology.address('decode')}:{PORTS['decode']}"),
        ],
    )
    try:
        for process in backends:
            process.start()
        for process in backends:
            address = process.wait_ready(180)
            host = process.name
            assert address == f"{topology.address(host)}:{PORTS[host.split('-')[0]]}"  # its own IP, not loopback
        # Counters from before the router starts: its warm-up request moves tensors too.
        sent_before = sum(topology.counters(h)["tx_bytes"] for h in ("encoder-0", "encoder-1"))
        prefill_sent_before = topology.counters("prefill")["tx_bytes"]
        router.start()
        router_address = router.wait_ready(60)
        names = sorted(MIXES)
        started = time.monotonic()
        reply = topology.exec("client", sys.executable, "-m", "tests.multihost.client", router_address, *names)
        elapsed = time.monotonic() - started
        assert reply.returncode == 0, reply.stderr[-3000:]
        got = json.loads(reply.stdout.strip().splitlines()[-1])
        assert got == {name: expected[name] for name in names}
        sent = sum(topology.counters(h)["tx_bytes"] for h in ("encoder-0", "encoder-1")) - sent_before
        read = _transferred_bytes(topology, "prefill")
        kv = _transferred_bytes(topology, "decode")
        assert read > 0 and kv > 0
        # With cross-memory attach the embeddings would not cross the veths at all.
        assert sent >= read, f"encoders sent {sent} B over eth0, prefill read {read} B of embeddings"
        prefill_sent = topology.counters("prefill")["tx_bytes"] - prefill_sent_before
        assert prefill_sent >= kv, f"prefill sent {prefill_sent} B over eth0, decode read {kv} B of KV"
        members = [json.loads(line) for line in router.log_tail(400).splitlines() if '"members changed"' in line]
        # The encoders' source (the prefill and decode pools log their own members too).
        members = [m for m in members if m["source"] == f"dns:///{ENCODERS_NAME}:{PORTS['encoder']}"]
        assert sorted(members[0]["added"]) == sorted(f"{topology.address(h)}:50061" for h in ("encoder-0", "encoder-1"))
        print(
            f"\nmulti-host golden: {len(names)} mixes equal generate() in {elapsed:.1f} s; router {router_address}, "
            f"encoders via dns:///{ENCODERS_NAME}; UCX_TLS=tcp UCX_NET_DEVICES=eth0; prefill read {read:.0f} B of "
            f"embeddings (encoders sent {sent} B on eth0), decode read {kv:.0f} B of KV (prefill sent {prefill_sent} B)"
        )
    finally:
        router.stop()
        statuses = {p.name: p.stop() for p in backends}
        dns.terminate()
        dns.wait(10)
        shutil.rmtree(resolver, ignore_errors=True)
    assert all(code == 0 for code in statuses.values()), statuses
