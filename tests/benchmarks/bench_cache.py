"""The reassignment experiment, at CPU scale (a benchmark script, not a test; pytest does not collect it).

    .venv/bin/python tests/benchmarks/bench_cache.py --size small --requests 16 --images 2

N requests with K distinct images each go through an E/P/D stack whose encoder A publishes to a
Mooncake Store. The same requests then go through a fresh encoder B twice, in the same run:
"before" with no shared store (B encodes everything again, as vLLM/SGLang/Dynamo would) and
"after" with the store A filled (B's router finds every item in the store and sends CACHED_ONLY
jobs: B loads instead of encoding). Reported: encodes on B and the
p90 time to first token, after/before, as a ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from libs.client.generate import GenerationResult, build_request, generate, open_channel  # noqa: E402
from libs.contract.epd.v1 import generate_pb2, media_pb2, sampling_pb2  # noqa: E402
from libs.launch.process import free_port  # noqa: E402
from libs.launch.stack import Stack, StackSpec  # noqa: E402
from libs.launch.store import start_store  # noqa: E402
from libs.model.checkpoints import ensure_checkpoint  # noqa: E402
from libs.model.media import synthetic  # noqa: E402


def _requests(n: int, k: int) -> list[generate_pb2.GenerateRequest]:
    out = []
    for i in range(n):
        media = [
            media_pb2.MediaItem(
                modality=media_pb2.MODALITY_IMAGE, data=synthetic.png_bytes(224, 224, seed=1000 * i + j)
            )
            for j in range(k)
        ]
        out.append(build_request("Describe these.", media, sampling=sampling_pb2.SamplingParams(max_tokens=4)))
    return out


async def _send(address: str, requests: list[generate_pb2.GenerateRequest]) -> list[GenerationResult]:
    async with open_channel(address) as channel:
        await channel.channel_ready()
        return [await generate(channel, r, timeout_s=300) for r in requests]


def _computes(port: int) -> int:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return int(sum(float(v) for v in re.findall(r"^epd_cache_computes_total(?:{[^}]*})? ([0-9.e+]+)$", text, re.M)))


def _phase(
    name: str, model: Path, run_dir: Path, master: str, requests: list[generate_pb2.GenerateRequest]
) -> tuple[int, float]:
    port = free_port()
    cache = ["--cache-master", master] if master else []  # the router short-circuits through the store too
    extra_args = {"encoder-0": ["--metrics-port", str(port), *cache], "router": cache}
    spec = StackSpec(layout="e/p/d", encoders=1, model=model, run_dir=run_dir / name, extra_args=extra_args)
    with Stack(spec).running() as stack:
        asyncio.run(_send(stack.address, [build_request("warm up")]))  # first-contact costs out of the figures
        results = asyncio.run(_send(stack.address, requests))
        computes = _computes(port)
    p90 = statistics.quantiles([r.ttft_s for r in results], n=10)[-1]
    print(f"{name:<28} encodes {computes:>4}   p90 TTFT {p90 * 1e3:8.1f} ms", flush=True)
    return computes, p90


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("tiny", "small"), default="small")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--images", type=int, default=2)
    ns = parser.parse_args()
    model = ensure_checkpoint("qwen2_5_omni", ns.size)
    requests = _requests(ns.requests, ns.images)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        store = start_store(run_dir / "store", segment_size=512 << 20)
        try:
            started = time.monotonic()
            print(f"qwen2_5_omni-{ns.size}: {ns.requests} requests x {ns.images} images, one encoder per stack")
            a, _ = _phase("A (fills the store)", model, run_dir, store.master_address, requests)
            before, p90_before = _phase("B before (no shared store)", model, run_dir, "", requests)
            after, p90_after = _phase("B after (store filled by A)", model, run_dir, store.master_address, requests)
        finally:
            store.stop()
    print(f"\nrepeated encodes on B: {before} -> {after} (A computed {a})")
    print(
        f"p90 TTFT after/before: {p90_after / p90_before:.3f}  ({p90_before * 1e3:.1f} ms -> {p90_after * 1e3:.1f} ms)"
    )
    print(f"total {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
