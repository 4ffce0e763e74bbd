"""Probe (not a test): how a configuration's streamed answers reach the client, one request at a time.

`make bench-vs-vllm` sees some of vLLM's documented deployments answer in one burst (TPOT ~0,
TTFT = the whole answer). This tells where the burst comes from: it deploys one configuration as
the benchmark does (tests/benchmarks/peers/vs_vllm.py), warms it up, then sends serial streamed chat requests
(one random 224x224 JPEG + text, 16 tokens, `ignore_eos`) through its front (EPD's door, or the
proxy of vLLM's split servers) and, for vLLM's deployments, the same request again straight to its
PD (or decode) server, with no proxy between. Per answer: TTFT, the span from the first content
chunk to the last, and the number of content chunks; at the end, the answers that came in one
burst (the span under 1 ms), per path.

    .venv/bin/python tests/benchmarks/answer_arrivals.py vllm-e+pd --starts 3 --requests 6
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from libs.model.checkpoints import ensure_checkpoint  # noqa: E402
from tests.benchmarks.peers import vs_vllm  # noqa: E402

FAMILY = "qwen2_5_vl"  # the benchmark's checkpoint (tests/benchmarks/bench_vs_vllm.py)
BURST_SPAN_MS = 1.0  # a whole answer whose content chunks arrived within this came in one burst


def image_url(rng: np.random.Generator) -> str:
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)).save(buf, format="JPEG")
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def answer(base_url: str, model: str, image: str, timeout_s: float = 60.0) -> list[float]:
    """When each content chunk of one streamed answer arrived, in ms from the request."""
    body = {
        "model": model, "stream": True, "max_tokens": 16, "ignore_eos": True,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "describe the picture in a few words"},
                                                  {"type": "image_url", "image_url": {"url": image}}]}],
    }  # fmt: skip
    request = urllib.request.Request(base_url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    start = time.perf_counter()
    arrived = []
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        for line in response:
            if line.startswith(b"data: ") and b'"content"' in line:
                arrived.append(1000 * (time.perf_counter() - start))
    if not arrived:
        raise RuntimeError(f"{base_url}: an answer without content")
    return arrived


def describe(arrived: list[float]) -> str:
    return f"TTFT {arrived[0]:6.1f} ms, span {arrived[-1] - arrived[0]:6.1f} ms, {len(arrived):2d} chunks"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", choices=vs_vllm.CONFIGS)
    parser.add_argument("--starts", type=int, default=3, help="deployments, one after the other")
    parser.add_argument("--requests", type=int, default=6, help="measured requests per start (after 3 warm-ups)")
    parser.add_argument("--ready-timeout-s", type=float, default=420.0)
    ns = parser.parse_args()
    model = ensure_checkpoint(FAMILY, "tiny")
    rng = np.random.default_rng(7)
    bursts = {"front": 0, "direct": 0}
    measured = {"front": 0, "direct": 0}
    for start in range(ns.starts):
        run_dir = ROOT / "var/run/answer-arrivals" / f"{ns.config.replace('/', '_')}-{start}"
        with vs_vllm.deployed(ns.config, model, run_dir, vs_vllm.Engine(), ns.ready_timeout_s) as dep:
            proxy = next((p for p in dep.procs if p.name == "proxy"), None)
            direct = proxy.args[proxy.args.index("--decode") + 1] if proxy else None
            for _ in range(3):
                answer(dep.base_url, dep.model, image_url(rng))
            for i in range(ns.requests):
                image = image_url(rng)
                paths = {"front": answer(dep.base_url, dep.model, image)}
                if direct:  # the same image again: the encoder's output is in the EC storage already
                    paths["direct"] = answer(direct, dep.model, image)
                for path, arrived in paths.items():
                    measured[path] += 1
                    bursts[path] += arrived[-1] - arrived[0] < BURST_SPAN_MS
                print(f"start {start} request {i}: " + " | ".join(f"{p} {describe(a)}" for p, a in paths.items()),
                      flush=True)  # fmt: skip
    for path, count in measured.items():
        if count:
            print(f"{ns.config} {path}: {bursts[path]} of {count} answers in one burst")


if __name__ == "__main__":
    main()
