"""The encoder's output cache in a live E/P/D stack: 16 concurrent requests carrying the same new
image cost exactly one encode (single-flight), a later one none (local hit), and every request
still gets its own embedding handle (pools back to empty). The shared store across stacks, the
router's short-circuit, a store killed mid-load and poisoned entries: test_shared_store.py."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pytest

from libs.client.generate import build_request
from libs.contract.epd.v1 import media_pb2, sampling_pb2
from libs.engine.media import synthetic
from libs.launch.process import free_port
from libs.launch.stack import Stack, StackSpec
from tests.services.conftest import run_requests, wait_pools_empty


def _counter(text: str, name: str) -> float:
    """Sum of a Prometheus counter's samples (all label sets)."""
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.MULTILINE))


@pytest.mark.timeout(180)
def test_same_new_image_is_encoded_once(model_path: Path, tmp_path: Path) -> None:
    port = free_port()
    spec = StackSpec(
        layout="e/p/d",
        encoders=1,
        model=model_path,
        run_dir=tmp_path,
        extra_args={"encoder-0": ["--metrics-port", str(port)]},
    )
    image = media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=synthetic.png_bytes(72, 56, seed=1234))

    def request(i: int) -> object:
        return build_request(
            "what is this", [image], sampling=sampling_pb2.SamplingParams(max_tokens=4), request_id=f"same-{i}"
        )

    with Stack(spec).running() as stack:
        first = run_requests(stack.address, [request(i) for i in range(16)])
        later = run_requests(stack.address, [request(16)])
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        wait_pools_empty(stack)
    assert len({tuple(r.token_ids) for r in [*first, *later]}) == 1  # same item, same tokens
    assert _counter(metrics, "epd_cache_computes_total") == 1
    lookups = _counter(metrics, "epd_cache_lookups_total")
    joins = _counter(metrics, "epd_cache_flight_joins_total")
    assert lookups >= 2 and joins + lookups >= 17  # everyone else shared the flight or hit the cache
