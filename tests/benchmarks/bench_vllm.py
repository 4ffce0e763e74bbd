"""Benchmark (not a test; `make bench-vllm`): time to first token and throughput of

- **epd**: EPD on vLLM, E+PD (router + the project's encoder + the PD service on vLLM, each its
  own process; embeddings over NIXL into vLLM's encoder cache);
- **vllm-e+pd**: vLLM's own E+PD: an encode-only vLLM instance (EC producer, vLLM's example EC
  connector on shared storage) and a PD instance (EC consumer), driven the way vLLM's example
  proxy does (the request to the encoder first, max_tokens 1, then to PD);
- **unsplit**: one vLLM engine, media in;

same checkpoint, same requests (one distinct image + text each), same concurrency; ratios from
this one run. Each configuration runs alone (they would share the host's cores).

    .venv/bin/python tests/benchmarks/bench_vllm.py [--family qwen2_5_vl] [--requests 16] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from libs.client.generate import build_request, generate, open_channel  # noqa: E402
from libs.contract.epd.v1 import media_pb2, sampling_pb2  # noqa: E402
from libs.launch.stack import Stack, StackSpec  # noqa: E402
from libs.model.checkpoints import ensure_checkpoint  # noqa: E402
from libs.model.media import synthetic  # noqa: E402

PROMPT = "Describe this."


def _images(n: int) -> list[bytes]:
    return [synthetic.png_bytes(112, 84, seed=100 + i) for i in range(n)]


def _summary(ttfts: list[float], tokens: int, wall: float) -> dict[str, float]:
    ordered = sorted(ttfts)
    return {
        "ttft_p50_ms": 1e3 * statistics.median(ordered),
        "ttft_p90_ms": 1e3 * ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
        "tok_per_s": tokens / wall,
        "wall_s": wall,
    }


async def _bounded(concurrency: int, jobs: list[Any]) -> list[Any]:
    gate = asyncio.Semaphore(concurrency)

    async def one(job: Any) -> Any:
        async with gate:
            return await job()

    return await asyncio.gather(*(one(job) for job in jobs))


def run_epd(model: Path, images: list[bytes], concurrency: int, max_tokens: int) -> dict[str, float]:
    spec = StackSpec(layout="e+pd", encoders=1, model=model, run_dir=ROOT / "var/run/bench-vllm", engine="vllm",
                     ready_timeout_s=420)  # fmt: skip
    with Stack(spec).running() as stack:

        async def load() -> dict[str, float]:
            async with open_channel(stack.address) as channel:
                sampling = sampling_pb2.SamplingParams(max_tokens=max_tokens)
                warm = build_request(PROMPT, [media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=images[0])],
                                     sampling=sampling)  # fmt: skip
                await generate(channel, warm, timeout_s=300)

                def job(data: bytes) -> Any:
                    item = media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=data)
                    return lambda: generate(channel, build_request(PROMPT, [item], sampling=sampling), timeout_s=300)

                started = time.perf_counter()
                results = await _bounded(concurrency, [job(d) for d in images[1:]])
                wall = time.perf_counter() - started
                return _summary([r.ttft_s for r in results], sum(r.completion_tokens for r in results), wall)

        return asyncio.run(load())


def child(mode: str, model: str, n: int, concurrency: int, max_tokens: int) -> None:
    """vLLM-only configurations, in a process of their own (spawn needs a __main__ guard)."""
    import io

    from PIL import Image
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.config import ECTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    tokenizer = AutoTokenizer.from_pretrained(model)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    images = [Image.open(io.BytesIO(b)).convert("RGB") for b in _images(n)]
    base = dict(model=model, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=64 << 20,
                max_model_len=4096, max_num_seqs=8, seed=0, disable_log_stats=True)  # fmt: skip
    storage = tempfile.mkdtemp(prefix="vllm-ec-")

    def engine(role: str | None) -> Any:
        args = dict(base)
        if role is not None:
            args["ec_transfer_config"] = ECTransferConfig(
                ec_connector="ECExampleConnector", ec_role=role,
                ec_connector_extra_config={"shared_storage_path": storage},
            )  # fmt: skip
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**args))

    async def main() -> dict[str, Any]:
        try:
            consumer = engine("ec_consumer" if mode == "vllm-e+pd" else None)
            producer = engine("ec_producer") if mode == "vllm-e+pd" else None
        except Exception as exc:  # report a configuration vLLM cannot run here
            return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA)

        async def one(image: Any) -> tuple[float, int]:
            prompt = {"prompt": text, "multi_modal_data": {"image": image}}
            started = time.perf_counter()
            if producer is not None:  # the example proxy: encode first, on the encoder instance
                async for _ in producer.generate(prompt, SamplingParams(max_tokens=1), uuid.uuid4().hex):
                    pass
            first, count = 0.0, 0
            async for out in consumer.generate(prompt, params, uuid.uuid4().hex):
                if out.outputs[0].token_ids and not first:
                    first = time.perf_counter() - started
                count += len(out.outputs[0].token_ids)
            return first, count

        try:
            await one(images[0])  # warm-up, as for epd
            started = time.perf_counter()
            results = await _bounded(concurrency, [lambda im=im: one(im) for im in images[1:]])
            wall = time.perf_counter() - started
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        finally:
            for e in (consumer, producer):
                if e is not None:
                    e.shutdown()
        return _summary([r[0] for r in results], sum(r[1] for r in results), wall)

    print("@@" + json.dumps(asyncio.run(main())), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="qwen2_5_vl")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    n = ns.requests + 1  # plus one warm-up
    if ns.child:
        child(ns.child, ns.model, n, ns.concurrency, ns.max_tokens)
        return
    model = ensure_checkpoint(ns.family, "tiny")
    results: dict[str, dict[str, Any]] = {"epd": run_epd(model, _images(n), ns.concurrency, ns.max_tokens)}
    for mode in ("vllm-e+pd", "unsplit"):
        argv = [sys.executable, __file__, "--child", mode, "--model", str(model), "--requests", str(ns.requests),
                "--concurrency", str(ns.concurrency), "--max-tokens", str(ns.max_tokens)]  # fmt: skip
        out = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
        lines = [line for line in out.stdout.splitlines() if line.startswith("@@")]
        results[mode] = json.loads(lines[-1][2:]) if lines else {"error": out.stderr[-300:]}
    print(f"{ns.family} tiny, {ns.requests} requests (1 image + text, {ns.max_tokens} tokens), concurrency "
          f"{ns.concurrency}, float32, 2 cores")  # fmt: skip
    print("| configuration | TTFT p50 (ms) | TTFT p90 (ms) | tokens/s | TTFT p50 vs unsplit | tokens/s vs unsplit |")
    print("|---|---|---|---|---|---|")
    base = results.get("unsplit", {})
    for mode, r in results.items():
        if "error" in r:
            print(f"| {mode} | not runnable here: {r['error']} | | | | |")
            continue
        ratio_t = r["ttft_p50_ms"] / base["ttft_p50_ms"] if "ttft_p50_ms" in base else float("nan")
        ratio_x = r["tok_per_s"] / base["tok_per_s"] if "tok_per_s" in base else float("nan")
        print(f"| {mode} | {r['ttft_p50_ms']:.0f} | {r['ttft_p90_ms']:.0f} | {r['tok_per_s']:.1f} | "
              f"{ratio_t:.2f}x | {ratio_x:.2f}x |")  # fmt: skip
    own = results.get("vllm-e+pd", {})
    if "ttft_p50_ms" in own and "ttft_p50_ms" in results["epd"]:
        ratio = results["epd"]["ttft_p50_ms"] / own["ttft_p50_ms"]
        print(f"EPD-on-vLLM TTFT p50 / vLLM's own E+PD TTFT p50: {ratio:.2f}x")


if __name__ == "__main__":
    main()
