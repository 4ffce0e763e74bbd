"""Evidence, not a test: where decode's time goes when vLLM prefill and decode run as two engines in
two processes with vLLM's NixlConnector on CPU, against unsplit vLLM, in one run.

Each variant starts a prefill engine (a child process) and a decode engine (this process's child),
sends the same text requests (P: max_tokens 1 with `do_remote_decode`; D: the same prompt with P's
`kv_transfer_params`, 16 tokens, ignore_eos), and times, per request: P, D's first token (KV read +
first step), D's whole stream, and the same prompt generated unsplit on the decode engine itself.

    .venv/bin/python tests/benchmarks/vllm_pd_cost.py --family qwen2_5_vl --requests 5

Variants (each applies to both engines):
- plain:    no KV connector; unsplit only (vLLM's own CPU thread binding).
- stock:    vLLM's NixlConnector as shipped (worker pinned to the last core, 4 UCX threads,
            spinning NIXL progress thread).
- affinity: the project's connector keeping the worker's CPU set, 1 UCX thread (progress thread
            still spinning).
- quiet:    + NIXL progress thread event-driven (the project's default).
- nobind:   + no OpenMP binding, one OpenMP thread per engine (VLLM_CPU_OMP_THREADS_BIND=nobind):
            the project's default for every vLLM engine.
- plain_nobind: unsplit, no KV connector, with nobind.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

PROMPT = "Tell me a story about a cat and a dog."
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {"connector": None, "nobind": False},
    "stock": {"connector": "stock", "nobind": False},
    "affinity": {"connector": "epd", "extra": {"num_threads": 1, "epd_progress_wakeup_s": None}, "nobind": False},
    "quiet": {"connector": "epd", "extra": {"num_threads": 1}, "nobind": False},
    "nobind": {"connector": "epd", "extra": {"num_threads": 1}, "nobind": True},
    "plain_nobind": {"connector": None, "nobind": True},
}


def _environment(variant: dict[str, Any], port: int) -> None:
    from libs.backends.vllm import runtime

    runtime.process_environment()
    loopback = {"VLLM_HOST_IP": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "UCX_NET_DEVICES": "lo"}
    os.environ.update(loopback)
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
    if variant["nobind"]:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        os.environ["OMP_NUM_THREADS"] = "1"


def _engine_args(model: str, variant: dict[str, Any], role: str) -> dict[str, Any]:
    from vllm.config import KVTransferConfig

    args: dict[str, Any] = dict(
        model=model, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=64 << 20, max_model_len=4096,
        max_num_seqs=8, seed=0, disable_log_stats=True,
    )  # fmt: skip
    if variant["connector"] == "stock":
        args["kv_transfer_config"] = KVTransferConfig(
            kv_connector="NixlConnector", kv_role=role, kv_buffer_device="cpu"
        )
    elif variant["connector"] == "epd":
        args["kv_transfer_config"] = KVTransferConfig(
            kv_connector="EpdNixlConnector",
            kv_connector_module_path="libs.backends.vllm.kv_connector",
            kv_role=role,
            kv_buffer_device="cpu",
            kv_connector_extra_config=dict(variant.get("extra", {})),
        )
    return args


def _prompt(model: str) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    messages = [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]
    return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def run_prefill(model: str, name: str, port: int) -> None:
    """Child: the prefill engine, one JSON request per stdin line, one JSON answer per line."""
    variant = VARIANTS[name]
    _environment(variant, port)
    from vllm import LLM, SamplingParams

    llm = LLM(**_engine_args(model, variant, "kv_producer"))
    print("@@READY", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        params = SamplingParams(
            temperature=0.0, max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}}
        )
        started = time.perf_counter()
        out = llm.generate([{"prompt": request["prompt"]}], params, use_tqdm=False)[0]
        answer = {"ms": 1e3 * (time.perf_counter() - started), "kv": out.kv_transfer_params,
                  "first": list(out.outputs[0].token_ids)}  # fmt: skip
        print("@@" + json.dumps(answer), flush=True)


def _read(pipe: Any) -> str:
    while True:
        line = pipe.readline()
        if not line:
            raise RuntimeError("the prefill engine exited")
        if line.startswith("@@"):
            return str(line[2:].strip())


async def _stream(llm: Any, prompt: str, params: Any, request_id: str) -> tuple[list[int], float, float]:
    """Tokens, seconds to the first output, seconds to the last."""
    started = time.perf_counter()
    first = 0.0
    tokens: list[int] = []
    async for out in llm.generate({"prompt": prompt}, params, request_id):
        if not first:
            first = time.perf_counter() - started
        tokens += out.outputs[0].token_ids
    return tokens, first, time.perf_counter() - started


def run_variant(model: str, name: str, requests: int, tokens: int) -> None:
    """Child: one variant (decode engine here, prefill engine in a grandchild); one JSON line out."""
    variant = VARIANTS[name]
    _environment(variant, 5622)
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    prompt = _prompt(model)
    prefill = None
    if variant["connector"]:
        env = dict(os.environ)
        prefill = subprocess.Popen(
            [sys.executable, __file__, "--prefill", model, name], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env=env, cwd=ROOT,
        )  # fmt: skip
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**_engine_args(model, variant, "kv_consumer")))
    if prefill is not None:
        assert _read(prefill.stdout) == "READY"

    def params(extra: dict[str, Any] | None = None) -> Any:
        return SamplingParams(
            temperature=0.0, max_tokens=tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA,
            extra_args=extra,
        )  # fmt: skip

    async def measure() -> dict[str, Any]:
        rows: list[dict[str, Any]] = []
        await _stream(llm, prompt, params(), "warm-up")
        for i in range(requests):
            row: dict[str, Any] = {}
            local, row["unsplit_first_s"], row["unsplit_s"] = await _stream(llm, prompt, params(), f"u{i}")
            if prefill is not None:
                assert prefill.stdin is not None
                prefill.stdin.write(json.dumps({"prompt": prompt}) + "\n")
                prefill.stdin.flush()
                answer = json.loads(_read(prefill.stdout))
                row["p_s"] = answer["ms"] / 1e3
                extra = {"kv_transfer_params": answer["kv"]}
                split, row["d_first_s"], row["d_s"] = await _stream(llm, prompt, params(extra), f"d{i}")
                # Decode's engine samples the first token again (it recomputes the prompt's last one).
                row["equal"] = split == local and answer["first"] == local[:1]
            rows.append(row)
        return {"variant": name, "rows": rows}

    try:
        result = asyncio.run(measure())
    finally:
        llm.shutdown()
        if prefill is not None:
            assert prefill.stdin is not None
            prefill.stdin.close()
            try:
                prefill.wait(timeout=60)
            except subprocess.TimeoutExpired:
                prefill.kill()
    print("@@" + json.dumps(result), flush=True)


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [row[key] for row in rows if key in row]
    return statistics.median(values) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="qwen2_5_vl")
    parser.add_argument("--variants", default="plain,stock,affinity,quiet,nobind,plain_nobind")
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--prefill", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--variant", nargs=2, help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.prefill:
        run_prefill(ns.prefill[0], ns.prefill[1], 5611)
        return
    if ns.variant:
        run_variant(ns.variant[0], ns.variant[1], ns.requests, ns.tokens)
        return
    from libs.model.checkpoints import ensure_checkpoint

    model = str(ensure_checkpoint(ns.family, "tiny"))
    results = []
    for name in ns.variants.split(","):
        started = time.monotonic()
        child = subprocess.run(
            [sys.executable, __file__, "--variant", model, name, "--requests", str(ns.requests),
             "--tokens", str(ns.tokens)],
            capture_output=True, text=True, cwd=ROOT,
        )  # fmt: skip
        lines = [line for line in child.stdout.splitlines() if line.startswith("@@")]
        if not lines:
            print(f"{name}: failed\n{child.stderr[-3000:]}", flush=True)
            continue
        result = json.loads(lines[-1][2:])
        results.append(result)
        print(f"{name}: {time.monotonic() - started:.0f} s, {json.dumps(result['rows'])}", flush=True)
    load = os.getloadavg()[0]
    base = next((_median(r["rows"], "unsplit_s") for r in results if r["variant"] == "plain"), None)
    print(f"\nload average {load:.1f}; medians over {ns.requests} requests, {ns.tokens} tokens; seconds")
    print("| variant | P | D first token | D total | D / unsplit, same engine | unsplit | D / plain unsplit | equal |")
    print("|---|---|---|---|---|---|---|---|")
    for result in results:
        rows = result["rows"]
        d, u = _median(rows, "d_s"), _median(rows, "unsplit_s")
        cells = [_median(rows, "p_s"), _median(rows, "d_first_s"), d, (d / u) if d and u else None, u,
                 (d / base) if d and base else None]  # fmt: skip
        text = ["-" if c is None else f"{c:.3f}" for c in cells]
        equal = all(row.get("equal", True) for row in rows) if any("equal" in r for r in rows) else "-"
        print(f"| {result['variant']} | " + " | ".join(text) + f" | {equal} |")


if __name__ == "__main__":
    main()
