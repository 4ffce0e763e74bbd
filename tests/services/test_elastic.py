"""Elastic encoder membership with real processes: a router reading its encoders from a watched file
(`--encoders file:///...`). An encoder added to the running stack starts taking work; an encoder
drained (SIGTERM) and taken out of the file under load loses no request. Every request carries a
new image (no cache hit, no affinity), so the encoders' own encode counters (Prometheus) show
who did the work; the same endpoint carries the occupancy gauge the encoder HPA reads. The drained
encoder holds an embedding no one has read yet, so it drains (refusing work) until the test has seen
the router's pick refused and has taken it out of the file, on any host."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from libs.client.generate import build_request, generate, open_channel
from libs.contract.epd.v1 import (
    encoder_pb2,
    encoder_pb2_grpc,
    lease_pb2,
    lease_pb2_grpc,
    sampling_pb2,
    tensor_pb2,
)
from libs.launch.k8s import LANE_LABEL, OCCUPANCY_METRIC
from libs.launch.process import ServiceProcess, free_port
from tests.support.load import Load, png_image
from tests.support.stacks import pool_stats, wait_for

pytestmark = pytest.mark.stack

REFRESH_S = 0.3


class Encoder:
    def __init__(self, name: str, model: Path, run_dir: Path) -> None:
        self.metrics_port = free_port()
        args = ["--model", str(model), "--pool-mib", "32", "--metrics-port", str(self.metrics_port)]
        # A drain waits for the embedding the test holds until it lets it go (within the grace).
        self.process = ServiceProcess(
            name, "services.encoder", [*args, "--grace-s", "120"], log_path=run_dir / f"{name}.log"
        )
        self.process.start()

    @property
    def address(self) -> str:
        return self.process.address

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as reply:
            return str(reply.read().decode())

    def encodes(self) -> int:
        """Items this encoder computed (the `encode` stage's histogram count)."""
        total = 0.0
        for line in self.metrics().splitlines():
            if line.startswith("epd_stage_duration_seconds_count{") and 'epd_stage="encode"' in line:
                total += float(line.rsplit(" ", 1)[1])
        return int(total)


def _members_changed(router: ServiceProcess, *, added: str = "", removed: str = "") -> bool:
    for line in router.log_tail(400).splitlines():
        if '"members changed"' in line:
            event = json.loads(line)
            if (not added or added in event["added"]) and (not removed or removed in event["removed"]):
                return True
    return False


def _refused(router: ServiceProcess, encoder: str) -> bool:
    """Whether the router logged a call to `encoder` failed (and retried on another encoder)."""
    for line in router.log_tail(2000).splitlines():
        if '"encoder failed; retrying elsewhere"' in line and json.loads(line)["encoder"] == encoder:
            return True
    return False


def _held_embedding(encoder: str, seed: int) -> str:
    """A new image encoded at `encoder` and never read (as by a consumer yet to read it): its lease."""
    item = encoder_pb2.EncodeItem(item_index=0, media=png_image(seed))
    request = encoder_pb2.EncodeRequest(
        request_id="held", items=[item], accepted_transports=[tensor_pb2.TRANSPORT_KIND_NIXL]
    )
    with grpc.insecure_channel(encoder) as channel:
        reply = encoder_pb2_grpc.EncoderServiceStub(channel).Encode(request, timeout=60)
    return str(reply.items[0].embeddings.lease_id)


def _release(producer: str, lease_id: str) -> None:
    request = lease_pb2.ReleaseLeasesRequest(lease_ids=[lease_id], reason=lease_pb2.RELEASE_REASON_ABANDONED)
    with grpc.insecure_channel(producer) as channel:
        lease_pb2_grpc.LeaseServiceStub(channel).ReleaseLeases(request, timeout=10)


def _idle(stats: Any) -> bool:
    return not (stats.pool.slots_in_use or stats.pool.active_leases or stats.requests_in_flight)


def _send(address: str, seeds: range) -> None:
    async def go() -> None:
        async with open_channel(address) as channel:
            for seed in seeds:
                request = build_request("Hi.", [png_image(seed)], sampling=sampling_pb2.SamplingParams(max_tokens=2))
                assert len((await generate(channel, request, timeout_s=60)).token_ids) == 2

    asyncio.run(go())


@pytest.fixture
def backends(model_path: Path, tmp_path: Path) -> Iterator[list[ServiceProcess]]:
    processes = [
        ServiceProcess(
            role,
            f"services.{role}",
            ["--model", str(model_path), "--pool-mib", "32"],
            log_path=tmp_path / f"{role}.log",
        )
        for role in ("prefill", "decode")
    ]
    for process in processes:
        process.start()
    yield processes
    for process in processes:
        process.stop()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_encoders_join_and_leave_a_running_stack(
    model_path: Path, tmp_path: Path, backends: list[ServiceProcess]
) -> None:
    members = tmp_path / "encoders"
    first = Encoder("encoder-a", model_path, tmp_path)
    encoders = [first]
    router = None
    try:
        for process in [*backends, first.process]:
            process.wait_ready(240)
        members.write_text(f"# members\n{first.address}\n")
        prefill, decode = backends
        router = ServiceProcess(
            "router",
            "services.router",
            [
                *("--layout", "e/p/d", "--prefill", prefill.address, "--decode", decode.address),
                *("--encoders", f"file://{members}", "--discovery-refresh-s", str(REFRESH_S)),
            ],
            log_path=tmp_path / "router.log",
        )
        router.start()
        address = router.wait_ready(60)
        warm_up = first.encodes()  # the router's own warm-up request, if any
        _send(address, range(3))
        assert first.encodes() - warm_up == 3

        # -- added -> used: a second encoder starts and is written into the file.
        second = Encoder("encoder-b", model_path, tmp_path)
        encoders.append(second)
        second.process.wait_ready(240)
        with members.open("a") as f:
            f.write(f"{second.address}\n")
        wait_for(
            lambda: "members changed" in router.log_tail(200) and second.address in router.log_tail(200), 60, "re-read"
        )
        # New images one at a time, 8 at least, until the added encoder took one: a new item goes to
        # its hash's choice of encoder (the addresses' ports are new each run), so 8 alone would all
        # miss it once in 256 runs.
        sent = 0
        while sent < 8 or (not second.encodes() and sent < 64):
            _send(address, range(100 + sent, 101 + sent))
            sent += 1
        used = second.encodes()
        assert used > 0, f"the added encoder took none of {sent} new items"
        assert first.encodes() - warm_up + used == 3 + sent
        # The gauge the encoder pool's HPA reads (deploy/k8s), exported by a real encoder.
        assert re.search(rf'^{OCCUPANCY_METRIC}\{{.*{LANE_LABEL}="encoder".*\}} ', second.metrics(), re.MULTILINE)

        # -- removed under load: the first encoder drains (SIGTERM), then leaves the file.
        load = Load(address).start()
        wait_for(lambda: load.done >= 6, 60, "load running")
        before = first.encodes()
        held = _held_embedding(first.address, seed=1)  # its drain waits for this one to be read or released
        stopper = threading.Thread(target=lambda: statuses.append(first.process.stop(timeout_s=180)))
        statuses: list[int | None] = []
        stopper.start()
        # The router still lists it: a pick of it gets UNAVAILABLE "draining" (retried elsewhere).
        wait_for(lambda: _refused(router, first.address), 60, "the router's pick of the draining encoder refused")
        members.write_text(f"{second.address}\n")
        wait_for(lambda: _members_changed(router, removed=first.address), 60, "the router dropping the drained one")
        _release(first.address, held)
        stopper.join(180)
        done_at_exit = load.done
        wait_for(lambda: load.done >= done_at_exit + 6, 60, "load continuing on the remaining encoder")
        load.stop()
        for process in (second.process, prefill, decode):
            wait_for(lambda p=process: _idle(pool_stats(p.address)), 15, f"{process.name}: nothing held")
    finally:
        if router is not None:
            router.stop()
        for encoder in encoders:
            encoder.process.stop()
    assert load.failures == [], load.failures[:5]
    assert statuses == [0]
    drained = [json.loads(line) for line in first.process.log_tail(400).splitlines() if '"drained"' in line]
    assert drained and drained[-1]["leases_still_held"] == 0 and drained[-1]["requests_finished"], drained
    print(
        f"\nelastic: added encoder took {used}/{sent} new items; {load.done} requests under load, 0 failed, "
        f"{done_at_exit} done when the drained encoder had exited and left the file "
        f"(it had computed {before} items before SIGTERM)"
    )
