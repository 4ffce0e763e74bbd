"""Prefill and decode pools with real processes (reference engine, tiny model, loopback): one router
reads its prefills and decodes from watched files (`--prefill file:///...`, `--decode file:///...`).

- A prefill and a decode added to the running stack start taking work.
- Under concurrent load, both members of each pool get work and every output equals the colocated
  model's golden tokens.
- A prefill and a decode drained (SIGTERM) and taken out of the files under load: 0 failed requests.

Who did the work is read from each service's own stage counters (Prometheus): the `prefill` stage
on a prefill, the `kv.transfer` span on a decode (one per request it decoded). One stack (an
encoder, two prefills, two decodes, the router) serves the module; each test writes the files it
needs first, and the drain test, which stops members, runs last. There the drained prefill holds a
KV cache no decode has read yet, so it drains (refusing work) until the test has seen the router's
picks of both leaving members refused and has taken them out of the files, on any host."""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from libs.contract.epd.v1 import lease_pb2, lease_pb2_grpc, prefill_pb2, prefill_pb2_grpc, tensor_pb2
from libs.launch.process import ServiceProcess, free_port
from libs.runtime.encoder_runner import EncoderRunner
from libs.runtime.lm_runtime import LanguageModelRuntime
from tests.support.golden import expected_tokens, request_for
from tests.support.load import Load, png_image
from tests.support.reference import load_reference
from tests.support.stacks import MIXES, pool_stats, run_requests, wait_for

pytestmark = pytest.mark.stack

REFRESH_S = 0.3
GOLDEN_MIXES = ("text", "image", "two_images", "audio_image")


class Member:
    """A prefill or decode process with its Prometheus port."""

    def __init__(self, name: str, role: str, model: Path, run_dir: Path) -> None:
        self.role = role
        self.metrics_port = free_port()
        # A drain waits for the KV cache the test holds until it lets it go (within the grace).
        args = ["--model", str(model), "--pool-mib", "32", "--metrics-port", str(self.metrics_port), "--grace-s", "120"]
        self.process = ServiceProcess(name, f"services.{role}", args, log_path=run_dir / f"{name}.log")
        self.process.start()

    @property
    def address(self) -> str:
        return self.process.address

    def served(self) -> int:
        """Requests this member worked on: prefills computed, or KV caches a decode read."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        marker = 'epd_stage="prefill"' if self.role == "prefill" else 'epd_span="kv.transfer"'
        return int(
            sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("epd_stage_duration_seconds_count{") and marker in line
            )
        )


@dataclass
class PoolStack:
    router: ServiceProcess
    address: str
    prefills: list[Member]
    decodes: list[Member]
    prefill_file: Path
    decode_file: Path
    golden: dict[str, list[int]]  # the colocated model's tokens per mix

    def members(self, prefills: list[Member], decodes: list[Member]) -> None:
        """Write both files and wait until the router uses exactly these members."""
        self.prefill_file.write_text("".join(f"{m.address}\n" for m in prefills))
        self.decode_file.write_text("".join(f"{m.address}\n" for m in decodes))
        for path, wanted in ((self.prefill_file, prefills), (self.decode_file, decodes)):
            want = {m.address for m in wanted}
            wait_for(lambda p=path, w=want: _members(self.router, p) == w, 20, f"the router re-reading {path.name}")

    def counts(self) -> dict[str, int]:
        return {m.process.name: m.served() for m in [*self.prefills, *self.decodes]}


def _members(router: ServiceProcess, path: Path) -> set[str]:
    """The router's members from `path` as its "members changed" log lines tell them."""
    members: set[str] = set()
    for line in router.log_tail(2000).splitlines():
        if '"members changed"' in line and str(path) in line:
            event = json.loads(line)
            members = (members | set(event["added"])) - set(event["removed"])
    return members


def _refused(router: ServiceProcess, stage: str, member: str) -> bool:
    """Whether the router logged a call to `member` of `stage` refused, or `member` unusable (and
    tried another member)."""
    events = {f"{stage} refused; trying another", f"{stage} not usable; trying another"}
    for line in router.log_tail(2000).splitlines():
        if f'"{stage} ' in line and '"member"' in line:
            event = json.loads(line)
            if event["event"] in events and event["member"] == member:
                return True
    return False


def _held_kv(prefill: str) -> str:
    """A prefill at `prefill` whose KV cache no decode reads (as one yet to read it): its lease."""
    request = prefill_pb2.PrefillRequest(
        request_id="held",
        messages=request_for(MIXES["text"]).messages,
        accepted_kv_transports=[tensor_pb2.TRANSPORT_KIND_NIXL],
    )
    request.sampling.max_tokens = 8
    with grpc.insecure_channel(prefill) as channel:
        reply = prefill_pb2_grpc.PrefillServiceStub(channel).Prefill(request, timeout=60)
    assert reply.HasField("kv_cache"), reply
    return str(reply.kv_cache.handle.lease_id)


def _release(producer: str, lease_id: str) -> None:
    request = lease_pb2.ReleaseLeasesRequest(lease_ids=[lease_id], reason=lease_pb2.RELEASE_REASON_ABANDONED)
    with grpc.insecure_channel(producer) as channel:
        lease_pb2_grpc.LeaseServiceStub(channel).ReleaseLeases(request, timeout=10)


def _golden(model_path: Path) -> dict[str, list[int]]:
    """The colocated model's greedy tokens for the mixes these tests send."""
    model = load_reference(str(model_path))
    runtime = LanguageModelRuntime(model_path)
    adapter = EncoderRunner(model_path).adapter
    return {name: expected_tokens(model, runtime, adapter, MIXES[name]) for name in GOLDEN_MIXES}


@pytest.fixture(scope="module")
def pools(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolStack]:
    run_dir = tmp_path_factory.mktemp("pools")
    encoder_args = ["--model", str(model_path), "--pool-mib", "32"]
    encoder = ServiceProcess("encoder", "services.encoder", encoder_args, log_path=run_dir / "encoder.log")
    encoder.start()
    prefills = [Member(f"prefill-{i}", "prefill", model_path, run_dir) for i in range(2)]
    decodes = [Member(f"decode-{i}", "decode", model_path, run_dir) for i in range(2)]
    members = [m.process for m in [*prefills, *decodes]]
    router = None
    try:
        golden = _golden(model_path)  # while the services load
        for process in [encoder, *members]:
            process.wait_ready(240)
        prefill_file, decode_file = run_dir / "prefills", run_dir / "decodes"
        prefill_file.write_text(f"{prefills[0].address}\n")
        decode_file.write_text(f"{decodes[0].address}\n")
        router = ServiceProcess(
            "router",
            "services.router",
            [
                *("--layout", "e/p/d", "--encoders", encoder.address),
                *("--prefill", f"file://{prefill_file}", "--decode", f"file://{decode_file}"),
                *("--discovery-refresh-s", str(REFRESH_S)),
            ],
            log_path=run_dir / "router.log",
        )
        router.start()
        address = router.wait_ready(60)
        yield PoolStack(router, address, prefills, decodes, prefill_file, decode_file, golden)
    finally:
        if router is not None:
            router.stop()
        stoppers = [threading.Thread(target=p.stop) for p in [*members, encoder]]  # drain all at once
        for stopper in stoppers:
            stopper.start()
        for stopper in stoppers:
            stopper.join(60)


def _send(stack: PoolStack, count: int, seed: int) -> None:
    """`count` image requests at once, each with a new image."""
    from libs.client.generate import build_request
    from libs.contract.epd.v1 import sampling_pb2

    requests = [
        build_request("Hi.", [png_image(seed + i)], sampling=sampling_pb2.SamplingParams(max_tokens=3))
        for i in range(count)
    ]
    results = run_requests(stack.address, requests, timeout_s=60)
    assert [len(r.token_ids) for r in results] == [3] * count


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_prefill_and_a_decode_added_take_work(pools: PoolStack) -> None:
    first_p, added_p = pools.prefills
    first_d, added_d = pools.decodes
    pools.members([first_p], [first_d])
    before = pools.counts()
    _send(pools, 3, seed=1)
    after = pools.counts()
    assert after[added_p.process.name] == before[added_p.process.name]  # not a member yet
    assert after[first_p.process.name] - before[first_p.process.name] == 3

    pools.members([first_p, added_p], [first_d, added_d])
    _send(pools, 6, seed=100)
    added = pools.counts()
    gained = {name: added[name] - after[name] for name in added}
    assert gained[added_p.process.name] > 0 and gained[added_d.process.name] > 0, gained
    assert sum(gained[m.process.name] for m in pools.prefills) == 6
    assert sum(gained[m.process.name] for m in pools.decodes) == 6
    print(f"\npools, added: 6 concurrent requests after the add -> {gained}")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_prefills_and_two_decodes_under_load_match_the_golden_tokens(pools: PoolStack) -> None:
    pools.members(pools.prefills, pools.decodes)
    before = pools.counts()
    names = [name for _ in range(3) for name in GOLDEN_MIXES]  # 12 requests at once
    results = run_requests(pools.address, [request_for(MIXES[name]) for name in names], timeout_s=120)
    got = [list(r.token_ids) for r in results]
    assert got == [pools.golden[name] for name in names]
    after = pools.counts()
    gained = {name: after[name] - before[name] for name in after}
    for member in [*pools.prefills, *pools.decodes]:
        assert gained[member.process.name] > 0, gained
    assert sum(gained[m.process.name] for m in pools.prefills) == len(names)
    # A request that finishes at its first token has no decode; none of these does.
    assert sum(gained[m.process.name] for m in pools.decodes) == len(names)
    print(f"\npools, golden: {len(names)} concurrent requests, tokens equal the colocated model's; {gained}")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_prefill_and_a_decode_drained_and_removed_under_load_lose_no_request(pools: PoolStack) -> None:
    pools.members(pools.prefills, pools.decodes)
    (keep_p, leave_p), (keep_d, leave_d) = pools.prefills, pools.decodes
    load = Load(pools.address).start()
    statuses: list[int | None] = []
    try:
        wait_for(lambda: load.done >= 6, 90, "load running")
        before = pools.counts()
        held = _held_kv(leave_p.address)  # the prefill's drain waits for it to be read or released
        stoppers = [
            threading.Thread(target=lambda m=m: statuses.append(m.process.stop(timeout_s=180)))
            for m in (leave_p, leave_d)
        ]
        for stopper in stoppers:
            stopper.start()
        # The router still lists them: its picks get UNAVAILABLE ("draining", or the decode gone
        # once its drain is over), retried on the other member.
        for stage, member in (("prefill", leave_p), ("decode", leave_d)):
            wait_for(lambda s=stage, m=member: _refused(pools.router, s, m.address), 90, f"a {stage} pick refused")
        pools.members([keep_p], [keep_d])
        _release(leave_p.address, held)
        for stopper in stoppers:
            stopper.join(180)
        done_at_exit = load.done
        wait_for(lambda: load.done >= done_at_exit + 6, 90, "load continuing on the remaining members")
    finally:
        load.stop()
    after = {m.process.name: m.served() for m in (keep_p, keep_d)}
    for process in (keep_p.process, keep_d.process):
        wait_for(lambda p=process: not pool_stats(p.address).pool.active_leases, 15, f"{process.name}: leases")
    assert load.failures == [], load.failures[:5]
    assert statuses == [0, 0]
    for member in (leave_p, leave_d):
        drained = [json.loads(line) for line in member.process.log_tail(400).splitlines() if '"drained"' in line]
        assert drained and drained[-1].get("leases_still_held", 0) == 0, (member.process.name, drained)
    print(
        f"\npools, drained: {load.done} requests under load, 0 failed; {done_at_exit} done when the drained prefill "
        f"and decode had exited and left the files; before SIGTERM {before}; remaining members after {after}"
    )
