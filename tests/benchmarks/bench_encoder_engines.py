"""Encoder throughput by engine (not a pytest test; `make bench-encoder`, prints one table):
images per second at 1, 4 and 16 concurrent `Encode` calls, the vLLM encoder (encoder-only, its
scheduler batching concurrent calls, outputs written into the encoder's pool) against the
reference encoder (one tower forward per call on its compute thread), same checkpoint.

    .venv/bin/python tests/benchmarks/bench_encoder_engines.py [--family qwen2_5_vl] [--calls 48]

Each engine runs alone: one encoder service process started, measured at every concurrency, then
stopped before the other starts. Every call encodes one distinct image (no cache: the reference
encoder runs with --cache-mib 0, the vLLM one keeps none) and asks for a NIXL handle, as the
router does; the lease is released right after the reply (ReleaseLeases), so the pool never
fills. A warm-up of `--warmup` calls precedes each concurrency. One run, figures for orientation:
on a shared 2-core host they move run to run.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from libs.contract.epd.v1 import (  # noqa: E402
    encoder_pb2,
    encoder_pb2_grpc,
    lease_pb2,
    lease_pb2_grpc,
    media_pb2,
    tensor_pb2,
)
from libs.launch.process import ServiceProcess  # noqa: E402
from libs.model.checkpoints import ensure_checkpoint  # noqa: E402
from libs.model.media import synthetic  # noqa: E402
from libs.rpc.server import open_channel  # noqa: E402

ENGINES = ("reference", "vllm")
CONCURRENCY = (1, 4, 16)


async def _measure(address: str, images: list[bytes], concurrency: int) -> float:
    """Images per second encoding `images` with `concurrency` calls in flight."""
    queue = list(enumerate(images))

    async with open_channel(address) as channel:
        encoder = encoder_pb2_grpc.EncoderServiceStub(channel)
        leases = lease_pb2_grpc.LeaseServiceStub(channel)

        async def worker() -> None:
            while queue:
                i, data = queue.pop()
                reply = await encoder.Encode(
                    encoder_pb2.EncodeRequest(
                        request_id=f"bench-{concurrency}-{i}",
                        items=[
                            encoder_pb2.EncodeItem(
                                item_index=0, media=media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=data)
                            )
                        ],
                        accepted_transports=[tensor_pb2.TRANSPORT_KIND_NIXL],
                    ),
                    timeout=120,
                )
                await leases.ReleaseLeases(
                    lease_pb2.ReleaseLeasesRequest(
                        lease_ids=[item.embeddings.lease_id for item in reply.items],
                        reason=lease_pb2.RELEASE_REASON_ABANDONED,
                    ),
                    timeout=10,
                )

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return len(images) / (time.perf_counter() - started)


def run_engine(engine: str, model: Path, args: argparse.Namespace, run_dir: Path) -> dict[int, float]:
    service_args = [
        *("--model", str(model), "--torch-threads", str(args.threads), "--pool-mib", "64"),
        *("--cache-mib", "0", "--max-running", str(max(CONCURRENCY)), "--max-batch", str(max(CONCURRENCY))),
        *("--max-waiting", "64"),
    ]
    if engine != "reference":
        service_args += ["--engine", engine]
    process = ServiceProcess(f"encoder-{engine}", "services.encoder", service_args, run_dir / f"{engine}.log")
    process.start()
    try:
        address = process.wait_ready(420.0)
        seed = 1000
        out: dict[int, float] = {}
        for concurrency in CONCURRENCY:
            warm = [synthetic.png_bytes(args.size, args.size, seed=seed + i) for i in range(args.warmup)]
            seed += args.warmup
            asyncio.run(_measure(address, warm, concurrency))
            images = [synthetic.png_bytes(args.size, args.size, seed=seed + i) for i in range(args.calls)]
            seed += args.calls
            out[concurrency] = asyncio.run(_measure(address, images, concurrency))
            print(f"  {engine:9s} c={concurrency:<3d} {out[concurrency]:7.1f} images/s", flush=True)
        return out
    finally:
        process.stop(timeout_s=60)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="qwen2_5_vl", choices=("qwen2_5_vl", "qwen3_vl"))
    parser.add_argument("--checkpoint-size", default="tiny")
    parser.add_argument("--size", type=int, default=224, help="image side, in pixels")
    parser.add_argument("--calls", type=int, default=48, help="timed Encode calls per concurrency")
    parser.add_argument("--warmup", type=int, default=4, help="untimed calls before each concurrency")
    parser.add_argument("--threads", type=int, default=1, help="--torch-threads of the encoder (vLLM: OMP threads)")
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    args = parser.parse_args(argv)
    model = ensure_checkpoint(args.family, args.checkpoint_size)
    results: dict[str, dict[int, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-encoder-") as run_dir:
        for engine in args.engines:
            results[engine] = run_engine(engine, model, args, Path(run_dir))
    print(
        f"\n{args.family}-{args.checkpoint_size}, {args.size}x{args.size} PNG, {args.calls} calls per point, images/s"
    )
    print("| engine | " + " | ".join(f"c={c}" for c in CONCURRENCY) + " |")
    print("|---|" + "---|" * len(CONCURRENCY))
    for engine, points in results.items():
        print(f"| {engine} | " + " | ".join(f"{points[c]:.1f}" for c in CONCURRENCY) + " |")
    if set(ENGINES) <= set(results):
        ratio = " | ".join(f"{results['vllm'][c] / results['reference'][c]:.2f}x" for c in CONCURRENCY)
        print(f"| vllm / reference | {ratio} |")


if __name__ == "__main__":
    main()
