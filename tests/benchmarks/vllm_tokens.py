"""Evidence, not a test: EPD on vLLM (E+PD: reference encoder + vLLM PD + router; E/P/D: reference
encoder + vLLM prefill + vLLM decode + router; each service its own process) against vLLM's own
unsplit run of the same tiny checkpoint and request (one `LLM`, vLLM preprocessing and encoding
the media itself), greedy, float32. Prints one table row per family, layout and mix.

    .venv/bin/python tests/benchmarks/vllm_tokens.py --families qwen2_5_omni qwen2_5_vl qwen3_vl \
        --layouts e+pd e/p/d

On another device (deploy/gpu/check_vllm_epd.sh): `--service-args "--device cuda"` reaches every
vLLM service (prefill, decode, PD), `--check` exits 1 when any row differs.
"""

from __future__ import annotations

import argparse
import io
import json
import shlex
import subprocess
import sys
import time
import wave
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from libs.launch.stack import Stack, StackSpec  # noqa: E402
from libs.runtime.checkpoints import ensure_checkpoint  # noqa: E402
from tests.support.vllm_stack import PROMPT, TOKENS, call, mixes, request  # noqa: E402

_KIND = {1: "image", 2: "video", 3: "audio"}  # media_pb2.Modality values


def _decoded(modality: int, data: bytes) -> Any:
    """The media as vLLM's offline API takes them (what our encoder decodes from the same bytes)."""
    import numpy as np

    if modality == 1:
        from PIL import Image

        return Image.open(io.BytesIO(data)).convert("RGB")
    if modality == 3:
        with wave.open(io.BytesIO(data)) as w:
            pcm = np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16)
            return pcm.astype(np.float32) / 32768.0, w.getframerate()
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        fps = float(stream.average_rate or 1)
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])
    meta = {"fps": fps, "duration": len(frames) / fps, "total_num_frames": len(frames),
            "frames_indices": list(range(len(frames))), "video_backend": "pyav", "do_sample_frames": True}  # fmt: skip
    return frames, meta


def unsplit(model: str, family: str) -> None:
    """Child process: vLLM alone, media in, tokens out (one JSON line)."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(model)
    llm = LLM(model=model, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=64 << 20,
              max_model_len=4096, max_num_seqs=8, seed=0)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS)
    out: dict[str, list[int] | str] = {}
    for mix in mixes(family):
        content: list[dict[str, str]] = [{"type": _KIND[m]} for m, _ in mix.media]
        content.append({"type": "text", "text": PROMPT})
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
        data: dict[str, list[Any]] = {}
        for m, raw in mix.media:
            data.setdefault(_KIND[m], []).append(_decoded(m, raw))
        prompt: dict[str, Any] = {"prompt": text}
        if data:
            prompt["multi_modal_data"] = {k: v[0] if len(v) == 1 else v for k, v in data.items()}
        try:
            result = llm.generate([prompt], params, use_tqdm=False)[0]
            out[mix.name] = list(result.outputs[0].token_ids)
        except Exception as exc:  # a mix vLLM cannot preprocess itself is reported, not fatal
            out[mix.name] = f"error: {type(exc).__name__}: {str(exc)[:120]}"
    print("@@" + json.dumps(out), flush=True)


def epd(
    model: Path, family: str, layout: str, run_dir: Path, service_args: list[str]
) -> tuple[dict[str, list[int]], float, dict[str, float]]:
    extra = {name: service_args for name in ("prefill", "decode", "pd")}
    spec = StackSpec(
        layout=layout, encoders=1, model=model, run_dir=run_dir, engine="vllm", ready_timeout_s=600, extra_args=extra
    )
    started = time.monotonic()
    tokens: dict[str, list[int]] = {}
    ttft: dict[str, float] = {}
    with Stack(spec).running() as stack:
        up = time.monotonic() - started
        for mix in mixes(family):
            result = call(stack.address, request(mix))
            tokens[mix.name] = result.token_ids
            ttft[mix.name] = result.ttft_s
    return tokens, up, ttft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=["qwen2_5_omni", "qwen2_5_vl", "qwen3_vl"])
    parser.add_argument("--layouts", nargs="+", default=["e+pd"], choices=["e+pd", "e/p/d"])
    parser.add_argument("--service-args", default="", help="flags for every vLLM service, e.g. '--device cuda'")
    parser.add_argument("--check", action="store_true", help="exit 1 when EPD's tokens differ from vLLM unsplit's")
    parser.add_argument("--unsplit", nargs=2, metavar=("MODEL", "FAMILY"), help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.unsplit:
        unsplit(*ns.unsplit)
        return
    rows = []
    for family in ns.families:
        model = ensure_checkpoint(family, "tiny")
        child = subprocess.run(
            [sys.executable, __file__, "--unsplit", str(model), family], capture_output=True, text=True, cwd=ROOT
        )
        lines = [line for line in child.stdout.splitlines() if line.startswith("@@")]
        theirs = json.loads(lines[-1][2:]) if lines else {}
        for layout in ns.layouts:
            run_dir = ROOT / "var" / "run" / f"vllm-tokens-{family}-{layout.replace('/', '-')}"
            ours, up, ttft = epd(model, family, layout, run_dir, shlex.split(ns.service_args))
            for name, tokens in ours.items():
                ref = theirs.get(name, "missing: " + child.stderr[-200:])
                rows.append((family, layout, name, tokens == ref, tokens, ref, ttft[name]))
            print(f"{family}: {layout} stack up in {up:.0f} s", flush=True)
    print("| family | layout | mix | EPD on vLLM == vLLM unsplit | EPD tokens | unsplit tokens | TTFT (ms) |")
    print("|---|---|---|---|---|---|---|")
    for family, layout, name, same, tokens, ref, t in rows:
        print(f"| {family} | {layout} | {name} | {'yes' if same else 'NO'} | {tokens} | {ref} | {t * 1e3:.0f} |")
    if ns.check and not all(row[3] for row in rows):
        print(f"golden check FAILED: {sum(not row[3] for row in rows)} of {len(rows)} rows differ", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
