"""Elastic encoder membership with real processes: a router reading its encoders from a watched file
(`--encoders file:///...`). An encoder added to the running stack starts taking work; an encoder
drained (SIGTERM) and taken out of the file under load loses no request. Every request carries a
new image (no cache hit, no affinity), so the encoders' own encode counters (Prometheus) show
who did the work; the same endpoint carries the occupancy gauge the encoder HPA reads."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from libs.client.generate import build_request, generate, open_channel
from libs.contract.epd.v1 import sampling_pb2
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
        self.process = ServiceProcess(
            name, "services.encoder", [*args, "--grace-s", "15"], log_path=run_dir / f"{name}.log"
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
            lambda: "members changed" in router.log_tail(200) and second.address in router.log_tail(200), 10, "re-read"
        )
        _send(address, range(100, 108))
        used = second.encodes()
        assert used > 0, "the added encoder took no work"
        assert first.encodes() - warm_up + used == 3 + 8
        # The gauge the encoder pool's HPA reads (deploy/k8s), exported by a real encoder.
        assert re.search(rf'^{OCCUPANCY_METRIC}\{{.*{LANE_LABEL}="encoder".*\}} ', second.metrics(), re.MULTILINE)

        # -- removed under load: the first encoder drains (SIGTERM), then leaves the file.
        load = Load(address).start()
        wait_for(lambda: load.done >= 6, 60, "load running")
        before = first.encodes()
        stopper = threading.Thread(target=lambda: statuses.append(first.process.stop(timeout_s=60)))
        statuses: list[int | None] = []
        stopper.start()
        time.sleep(1.0)  # the router still lists it: its picks get UNAVAILABLE "draining"
        members.write_text(f"{second.address}\n")
        wait_for(lambda: _members_changed(router, removed=first.address), 10, "the router dropping the drained one")
        stopper.join(90)
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
        f"\nelastic: added encoder took {used}/8 new items; {load.done} requests under load, 0 failed, "
        f"{done_at_exit} done when the drained encoder had exited and left the file "
        f"(it had computed {before} items before SIGTERM)"
    )
