"""vLLM's step compiled against eager, the engine alone (not a test): where EPD's default of
compiling the language model comes from (docs/vllm-operations.md, `--enforce-eager`).

One vLLM AsyncLLM as EPD's services run it on CPU (the model inside EngineCore, float32, greedy,
this process pinned where it starts), text prompts, 128 tokens each; for batch 1, 4 and 8 (that
many requests at once) six rounds, the first one dropped: the median gap between a request's
streamed tokens per round, and a digest of every token generated (the two modes must agree). Run
each mode a few times, alternating: this host's CPUs change speed on their own
(tests/benchmarks/cpu_speed.py).

    taskset -c 1 .venv/bin/python tests/benchmarks/vllm_compiled_step.py eager
    taskset -c 1 .venv/bin/python tests/benchmarks/vllm_compiled_step.py compiled
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

BATCHES = (1, 4, 8)
ROUNDS = 6  # per batch; the first is a warm-up
TOKENS = 128


async def run(model: Path, eager: bool) -> None:
    from libs.backends.vllm.runtime import process_environment

    os.environ.update({"VLLM_TARGET_DEVICE": "cpu", "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                       "VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1",
                       "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})  # fmt: skip
    process_environment()
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    start = time.perf_counter()
    engine = AsyncEngineArgs(model=str(model), dtype="float32", enforce_eager=eager, max_model_len=4096,
                             max_num_seqs=8, kv_cache_memory_bytes=64 << 20, seed=0,
                             distributed_executor_backend="uni")  # fmt: skip
    llm = AsyncLLM.from_engine_args(engine)
    mode = "eager" if eager else "compiled"
    print(f"{mode}: engine up in {time.perf_counter() - start:.1f} s", flush=True)
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True, temperature=0, output_kind=RequestOutputKind.DELTA)
    tokens: dict[str, list[int]] = {}

    async def one(request_id: str) -> list[float]:
        arrivals = []
        async for out in llm.generate(f"hello world {request_id} " * 8, params, request_id=request_id):
            arrivals.append(time.perf_counter())
            tokens.setdefault(request_id, []).extend(out.outputs[0].token_ids)
        return [b - a for a, b in itertools.pairwise(arrivals)]

    try:
        for batch in BATCHES:
            per_round = []
            for r in range(ROUNDS):
                gaps = await asyncio.gather(*(one(f"b{batch}r{r}i{i}") for i in range(batch)))
                if r > 0:
                    per_round.append(1000 * statistics.median(g for request in gaps for g in request))
            rounds = " ".join(f"{ms:.2f}" for ms in per_round)
            print(f"{mode} batch {batch}: ms per token per round {rounds} | median {statistics.median(per_round):.2f}")
        digest = hashlib.sha1(repr(sorted(tokens.items())).encode()).hexdigest()[:12]
        print(f"{mode}: tokens digest {digest}")
    finally:
        llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("eager", "compiled"))
    parser.add_argument("--model", type=Path, default=ROOT / "var/models/qwen2_5_vl-tiny")
    args = parser.parse_args()
    asyncio.run(run(args.model, args.mode == "eager"))


if __name__ == "__main__":
    main()
