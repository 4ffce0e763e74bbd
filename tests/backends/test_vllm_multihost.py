"""E/P/D on vLLM across hosts: a reference encoder, prefill and decode on vLLM, the router and the
client each in its own network namespace (its own IP on a bridge, not loopback), as
tests/services/test_multihost.py runs the reference engine. Every NIXL agent is forced onto UCX's
TCP transport over the veths (`--ucx-tls tcp --ucx-net-devices eth0`): the project's agents and,
through the services' settings, vLLM's own (the worker's EC reads and vLLM's NixlConnector, whose
side channel is served on prefill's address). Tokens equal the reference runtime's; the interface
counters show the bytes crossed: the encoder's eth0 sent at least the embeddings prefill's engine
read, prefill's eth0 at least the KV blocks decode's engine read."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from libs.launch.process import ServiceProcess
from tests.multihost.metrics import transferred_bytes
from tests.support.netns import NamespacesUnavailable, Topology, namespaces
from tests.support.vllm_stack import mixes, reference_tokens

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

HOSTS = ["client", "router", "encoder", "prefill", "decode"]
PORTS = {"router": 50051, "encoder": 50061, "prefill": 50071, "decode": 50081}
METRICS_PORT = 9090
TRANSPORT = ["--ucx-tls", "tcp", "--ucx-net-devices", "eth0"]
MIXES = ["text", "image", "audio"]  # text: no embeddings; image and audio: E->P reads


@pytest.fixture
def topology() -> Iterator[Topology]:
    try:
        topo = Topology(HOSTS)
    except NamespacesUnavailable as exc:
        pytest.fail(f"multi-host test needs network namespaces: {exc}")
    with topo:
        yield topo
    assert not [n for n in namespaces() if n.startswith(topo.run)]


@pytest.mark.timeout(600)
def test_epd_on_vllm_across_namespaces_over_tcp(topology: Topology, omni_tiny: Path, tmp_path: Path) -> None:
    by_name = {mix.name: mix for mix in mixes("qwen2_5_omni")}
    expected = {name: reference_tokens(omni_tiny, by_name[name]) for name in MIXES}
    model = ["--model", str(omni_tiny), "--pool-mib", "32", *TRANSPORT, "--metrics-port", str(METRICS_PORT)]
    vllm = ["--engine", "vllm", "--device", "cpu"]  # today's CPU values, said explicitly

    def service(host: str, args: list[str]) -> ServiceProcess:
        where = ["--host", topology.address(host), "--port", str(PORTS[host])]
        return ServiceProcess(
            host, f"services.{host}", [*args, *where], log_path=tmp_path / f"{host}.log", netns=topology.namespace(host)
        )

    backends = [service("encoder", model), service("prefill", [*model, *vllm]), service("decode", [*model, *vllm])]
    router = service(
        "router",
        [
            *("--layout", "e/p/d", "--encoders", f"{topology.address('encoder')}:{PORTS['encoder']}"),
            *("--prefill", f"{topology.address('prefill')}:{PORTS['prefill']}"),
            *("--decode", f"{topology.address('decode')}:{PORTS['decode']}"),
        ],
    )
    try:
        for process in backends:
            process.start()
        for process in backends:
            address = process.wait_ready(420)
            assert address == f"{topology.address(process.name)}:{PORTS[process.name]}"  # its own IP
        # Counters from before the router starts: its warm-up request moves tensors too.
        encoder_sent_before = topology.counters("encoder")["tx_bytes"]
        prefill_sent_before = topology.counters("prefill")["tx_bytes"]
        router.start()
        router_address = router.wait_ready(60)
        started = time.monotonic()
        reply = topology.exec(
            "client", sys.executable, "-m", "tests.multihost.vllm_client", router_address, *MIXES, timeout=300
        )
        elapsed = time.monotonic() - started
        assert reply.returncode == 0, reply.stderr[-3000:]
        got = json.loads(reply.stdout.strip().splitlines()[-1])
        assert got == expected
        embeddings = transferred_bytes(topology, "prefill", METRICS_PORT)  # read by prefill's vLLM worker
        kv = transferred_bytes(topology, "decode", METRICS_PORT)  # KV blocks decode's vLLM worker read
        assert embeddings > 0 and kv > 0
        # With loopback or cross-memory attach these bytes would not cross the veths at all.
        encoder_sent = topology.counters("encoder")["tx_bytes"] - encoder_sent_before
        assert encoder_sent >= embeddings, f"encoder sent {encoder_sent} B on eth0, prefill read {embeddings} B"
        prefill_sent = topology.counters("prefill")["tx_bytes"] - prefill_sent_before
        assert prefill_sent >= kv, f"prefill sent {prefill_sent} B on eth0, decode read {kv} B of KV"
        print(
            f"\nmulti-host E/P/D on vLLM: {len(MIXES)} mixes equal the reference runtime in {elapsed:.1f} s; "
            f"UCX_TLS=tcp UCX_NET_DEVICES=eth0; prefill read {embeddings:.0f} B of embeddings (encoder sent "
            f"{encoder_sent} B on eth0), decode read {kv:.0f} B of KV (prefill sent {prefill_sent} B on eth0)"
        )
    finally:
        router.stop()
        statuses = {p.name: p.stop() for p in backends}
    assert all(code == 0 for code in statuses.values()), statuses
