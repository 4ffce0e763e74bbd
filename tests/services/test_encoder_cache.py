"""The encoder's output cache in a live E/P/D stack: 16 concurrent requests carrying the same new
image, through two routers onto two encoders, cost exactly one encode (the routers place the item
on one encoder, whose single-flight computes it once), a later one none (local hit), and every
request still gets its own embedding handle (pools back to empty). The shared store across stacks, the
router's short-circuit, a store killed mid-load and poisoned entries: test_shared_store.py."""

from __future__ import annotations

import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from libs.contract.epd.v1 import generate_pb2
from libs.launch.process import ServiceProcess, free_port
from libs.launch.stack import Stack, StackSpec
from tests.support.golden import request_for
from tests.support.metrics import counter_total
from tests.support.stacks import MIXES, run_requests, wait_pools_empty

pytestmark = pytest.mark.stack


@pytest.mark.timeout(240)
def test_same_new_image_is_encoded_once(model_path: Path, tmp_path: Path, expected: dict[str, list[int]]) -> None:
    """16 concurrent requests, half through a second router, two encoders: one encode in all."""
    ports = [free_port(), free_port()]
    spec = StackSpec(
        layout="e/p/d",
        encoders=2,
        model=model_path,
        run_dir=tmp_path,
        extra_args={f"encoder-{i}": ["--metrics-port", str(port)] for i, port in enumerate(ports)},
    )

    def request(i: int) -> generate_pb2.GenerateRequest:
        # The golden "image" mix: new to this stack (started here), and with known tokens.
        return request_for(MIXES["image"], request_id=f"same-{i}")

    with Stack(spec).running() as stack:
        p = stack.processes
        second_router = ServiceProcess(
            "router-2",
            "services.router",
            [
                *("--encoders", f"{p['encoder-0'].address},{p['encoder-1'].address}"),
                *("--prefill", p["prefill"].address, "--decode", p["decode"].address),
            ],
            log_path=tmp_path / "router-2.log",
        )
        second_router.start()
        try:
            address_2 = second_router.wait_ready(60)
            with ThreadPoolExecutor(2) as pool:
                halves = [
                    pool.submit(run_requests, stack.address, [request(i) for i in range(8)]),
                    pool.submit(run_requests, address_2, [request(i) for i in range(8, 16)]),
                ]
                first = [r for half in halves for r in half.result(timeout=120)]
            later = run_requests(stack.address, [request(16)])
        finally:
            second_router.stop()
        texts = [urllib.request.urlopen(f"http://127.0.0.1:{p}/metrics", timeout=10).read().decode() for p in ports]
        wait_pools_empty(stack)
    assert len(first) == 16
    assert [r.token_ids for r in [*first, *later]] == [expected["image"]] * 17  # the model's own tokens, each
    assert sum(counter_total(t, "epd_cache_computes_total") for t in texts) == 1
    lookups = sum(counter_total(t, "epd_cache_lookups_total") for t in texts)
    joins = sum(counter_total(t, "epd_cache_flight_joins_total") for t in texts)
    assert lookups >= 2 and joins + lookups >= 17  # everyone else shared the flight or hit the cache
