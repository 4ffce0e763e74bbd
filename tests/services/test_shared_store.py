"""The shared encoder cache (a real Mooncake master + holder) through live stacks.

- Router short-circuit: stack A computes items and publishes them; stack B (fresh encoder, fresh
  router, same store) finds them in the store before dispatch, sends CACHED_ONLY jobs and computes
  nothing, with tokens equal to A's.
- Store killed mid-load: B's loads hang on a frozen holder, then master and holder are killed: every
  request still completes with the right tokens (the router falls back to computing).
- Poisoned entries (another model's identity, a wrong shape) planted under the right keys are never
  served: the encoder rejects them, computes, and the tokens equal the model's generate().
"""

from __future__ import annotations

import os
import re
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from libs.cache.cache import CacheEntry
from libs.cache.entry import encode
from libs.cache.keys import Namespace, wire_content_hash
from libs.cache.store import MooncakeStoreClient, StoreConfig
from libs.client.generate import build_request
from libs.contract.epd.v1 import generate_pb2, media_pb2, sampling_pb2, service_info_pb2, service_info_pb2_grpc
from libs.launch.process import free_port
from libs.launch.stack import Stack, StackSpec
from libs.launch.store import start_store
from libs.model.dtypes import dtype_name
from libs.model.media import synthetic
from libs.runtime.encoder_runner import EncoderRunner
from libs.serving.convert import media_input
from libs.telemetry.report import breakdowns
from libs.telemetry.spans import by_trace, load_jsonl
from tests.support.golden import request_for
from tests.support.stacks import MIXES, pool_stats, run_requests, wait_pools_empty

pytestmark = pytest.mark.stack


def _counter(port: int, name: str, **labels: str) -> float:
    """Sum of a Prometheus counter's samples on a live service, over samples carrying `labels`."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    total = 0.0
    for label_text, value in re.findall(rf"^{name}(?:{{([^}}]*)}})? ([0-9.e+]+)$", text, re.MULTILINE):
        if all(f'{k}="{v}"' in (label_text or "") for k, v in labels.items()):
            total += float(value)
    return total


def _wait_for(condition: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _image_request(seed: int) -> generate_pb2.GenerateRequest:
    image = media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=synthetic.png_bytes(56, 84, seed=seed))
    sampling = sampling_pb2.SamplingParams(max_tokens=4)
    return build_request("what is this", [image], sampling=sampling, request_id=f"image-{seed}")


def _renamed(request: generate_pb2.GenerateRequest, prefix: str) -> generate_pb2.GenerateRequest:
    copy = generate_pb2.GenerateRequest()
    copy.CopyFrom(request)
    copy.request_id = f"{prefix}-{request.request_id}"
    return copy


class Ports:
    def __init__(self) -> None:
        self.encoder, self.router = free_port(), free_port()


def _spec(model: Path, run_dir: Path, master: str, ports: Ports) -> StackSpec:
    """One encoder and a router pointed at an existing store (so two stacks can share it); spans
    go to run_dir/spans.jsonl."""
    cache = ["--cache-master", master]
    return StackSpec(
        layout="e/p/d",
        encoders=1,
        model=model,
        run_dir=run_dir,
        env={"EPD_TRACE_EXPORTER": "jsonl", "EPD_TRACE_FILE": str(run_dir / "spans.jsonl")},
        extra_args={
            "encoder-0": [*cache, "--metrics-port", str(ports.encoder)],
            # A generous lookup deadline: on a loaded CI host a late answer would count as a miss.
            "router": [*cache, "--metrics-port", str(ports.router), "--cache-lookup-timeout-s", "2"],
        },
    )


@pytest.mark.timeout(300)
def test_router_short_circuit_and_a_store_killed_mid_load(model_path: Path, tmp_path: Path) -> None:
    store = start_store(tmp_path / "store", segment_size=64 << 20)
    # B serves these from the store: images, a video and an audio clip.
    short = [_image_request(seed) for seed in range(4)]
    short += [request_for(MIXES[name], max_tokens=4, request_id=name) for name in ("video", "audio")]
    during = [_image_request(seed) for seed in range(100, 108)]  # in flight when the store dies
    try:
        a_ports, b_ports = Ports(), Ports()
        with Stack(_spec(model_path, tmp_path / "a", store.master_address, a_ports)).running() as a:
            want = [r.token_ids for r in run_requests(a.address, short + during)]
            _wait_for(
                lambda: _counter(a_ports.encoder, "epd_cache_publishes_total", epd_cache_status="ok") >= 14,
                30,
                "stack A's publishes",
            )
            assert _counter(a_ports.encoder, "epd_cache_computes_total") == 14

        with Stack(_spec(model_path, tmp_path / "b", store.master_address, b_ports)).running() as b:
            # 1. Short-circuit: found in the store before dispatch, so no encoder computes.
            got = [r.token_ids for r in run_requests(b.address, short)]
            assert got == want[: len(short)]
            assert _counter(b_ports.router, "epd_router_cache_lookups_total", epd_cache_result="hit") == len(short)
            assert _counter(b_ports.encoder, "epd_cache_computes_total") == 0
            assert _counter(b_ports.encoder, "epd_cache_lookups_total", epd_cache_result="store_hit") == len(short)

            # 2. Store killed mid-load: the holder freezes (the master still answers lookups, so the
            # router sends CACHED_ONLY jobs whose loads hang), then master and holder are killed.
            assert store.holder is not None and store.master is not None
            os.kill(store.holder.pid, signal.SIGSTOP)
            with ThreadPoolExecutor(1) as pool:
                pending = pool.submit(run_requests, b.address, during)
                _wait_for(
                    lambda: (
                        _counter(b_ports.router, "epd_router_cache_lookups_total", epd_cache_result="hit")
                        >= len(short) + len(during)
                    ),
                    30,
                    "the router's lookups of the in-flight items",
                )
                # The cache-only jobs are in the encoder, their loads waiting on the frozen holder.
                _wait_for(
                    lambda: pool_stats(b.processes["encoder-0"].address).requests_in_flight > 0,
                    30,
                    "a cache-only job in the encoder",
                )
                os.kill(store.holder.pid, signal.SIGKILL)
                os.kill(store.master.pid, signal.SIGKILL)
                results = pending.result(timeout=120)
            assert [r.token_ids for r in results] == want[len(short) :]  # no failed request
            assert _counter(b_ports.encoder, "epd_cache_computes_total") == len(during)
            assert _counter(b_ports.encoder, "epd_cache_loads_total", epd_cache_status="ok") == len(short)

            # 3. With the store gone, requests still succeed (lookups are misses; B's LRU has these).
            again = run_requests(b.address, [_renamed(r, "again") for r in during[:3] + short[:1]])
            assert [r.token_ids for r in again] == want[len(short) : len(short) + 3] + want[:1]
            assert _counter(b_ports.encoder, "epd_cache_computes_total") == len(during)
            wait_pools_empty(b)
    finally:
        store.stop()
    _check_short_circuit_traces(tmp_path / "b" / "spans.jsonl", {r.request_id for r in short})


def _check_short_circuit_traces(path: Path, request_ids: set[str]) -> None:
    """Each short-circuited request's trace shows the router's store lookup (a hit), the encoder's
    load from the store and no encoder compute, and its TTFT split has a cache_load part."""
    traces = by_trace(load_jsonl(path))
    found = {b.request_id: b for b in breakdowns(load_jsonl(path)) if b.request_id in request_ids}
    assert set(found) == request_ids
    for breakdown in found.values():
        spans = traces[breakdown.trace_id]
        names = {s.name: s for s in spans}
        assert names["router.cache_lookup"].attributes["epd.cache.result"] == "hit"
        assert names["epd.encode.item"].attributes["epd.cache.policy"] == "CACHE_POLICY_CACHED_ONLY"
        assert names["cache.load"].attributes["epd.cache.status"] == "ok"
        assert "encoder.compute" not in names and "encoder.cached.queue" in names
        assert breakdown.parts["cache_load"] > 0 and breakdown.parts["encode"] == 0


def _encoder_namespace(
    address: str, dtype: str, preprocessing: str
) -> tuple[Namespace, service_info_pb2.EncoderCacheInfo]:
    with grpc.insecure_channel(address) as channel:
        info = (
            service_info_pb2_grpc.ServiceInfoServiceStub(channel)
            .GetServiceInfo(service_info_pb2.GetServiceInfoRequest(), timeout=10)
            .info
        )
    model = info.model
    namespace = Namespace(model.model_id, model.revision, model.weights_digest, dtype, preprocessing=preprocessing)
    return namespace, info.encoder_cache


@pytest.mark.timeout(240)
def test_poisoned_store_entries_are_never_served(
    model_path: Path, tmp_path: Path, expected: dict[str, list[int]]
) -> None:
    ports = Ports()
    spec = StackSpec(
        layout="e/p/d",
        encoders=1,
        model=model_path,
        run_dir=tmp_path,
        cache_store=True,  # master + holder started and stopped by the launcher
        extra_args={
            "encoder-0": ["--metrics-port", str(ports.encoder)],
            "router": ["--metrics-port", str(ports.router), "--cache-lookup-timeout-s", "2"],
        },
    )
    runner = EncoderRunner(model_path)
    names = ("image", "video")  # planted: another model's entry; an entry one row short
    requests = {name: request_for(MIXES[name]) for name in names}
    with Stack(spec).running() as stack:
        assert stack.store is not None
        namespace, cache_info = _encoder_namespace(
            stack.processes["encoder-0"].address, dtype_name(runner.dtype), runner.preprocessing_digest
        )
        assert cache_info.shared_store and cache_info.key_prefix == namespace.key_prefix
        client = MooncakeStoreClient(StoreConfig(stack.store.master_address))
        try:
            for name, request in requests.items():
                wire = next(p.media for m in request.messages for p in m.parts if p.HasField("media"))
                (item,) = runner.encode([media_input(wire, 0, wire.data)])
                if name == "image":
                    other = Namespace("someone-else/model", "main", "ab" * 32, namespace.dtype)
                    poisoned = CacheEntry(other, item.layout, dict(item.tensors))
                else:
                    tensors = {k: v[:-1] for k, v in item.tensors.items()}
                    poisoned = CacheEntry(namespace, item.layout, tensors)
                key = f"{namespace.key_prefix}/{wire_content_hash(wire, wire.data)}"
                assert client.put(key, encode(poisoned)).ok
            results = run_requests(stack.address, list(requests.values()))
        finally:
            client.close()
        assert {n: r.token_ids for n, r in zip(names, results, strict=True)} == {n: expected[n] for n in names}
        hits = _counter(ports.router, "epd_router_cache_lookups_total", epd_cache_result="hit")
        assert hits == len(names)  # the router saw the planted entries and sent CACHED_ONLY jobs
        assert _counter(ports.encoder, "epd_cache_invalid_total", epd_cache_fault="namespace_mismatch") == 1
        assert _counter(ports.encoder, "epd_cache_invalid_total", epd_cache_fault="spec_mismatch") == 1
        assert _counter(ports.encoder, "epd_cache_computes_total") == len(names)  # computed instead
        wait_pools_empty(stack)
