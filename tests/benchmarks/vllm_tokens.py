"""Evidence, not a test: EPD on vLLM (E+PD: encoder + vLLM PD + router; E/P/D: encoder + vLLM
prefill + vLLM decode + router; each service its own process; the encoder on the reference engine
or on vLLM) against vLLM's own unsplit run of the same tiny checkpoint and request (one `LLM`, vLLM
preprocessing and encoding the media itself, tests/support/vllm_unsplit.py) and against the
reference runtime, greedy, float32. Prints one table row per family, layout, encoder and mix.

    .venv/bin/python tests/benchmarks/vllm_tokens.py --families qwen2_5_omni qwen2_5_vl qwen3_vl \
        --layouts e+pd e/p/d --encoder-engines reference vllm

On another device (deploy/gpu/check_vllm_epd.sh): `--service-args "--device cuda"` reaches every
vLLM service (prefill, decode, PD), `--check` exits 1 when any row differs.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from libs.launch.stack import Stack, StackSpec  # noqa: E402
from libs.model.checkpoints import ensure_checkpoint  # noqa: E402
from tests.support.vllm_stack import call, mixes, reference_tokens, request  # noqa: E402
from tests.support.vllm_unsplit import unsplit_tokens  # noqa: E402


def epd(
    model: Path, family: str, layout: str, encoder_engine: str, run_dir: Path, service_args: list[str]
) -> tuple[dict[str, list[int]], float, dict[str, float]]:
    vllm_services = ("prefill", "decode", "pd", *(("encoder-0",) if encoder_engine == "vllm" else ()))
    extra = {name: service_args for name in vllm_services}
    spec = StackSpec(
        layout=layout, encoders=1, model=model, run_dir=run_dir, engine="vllm", encoder_engine=encoder_engine,
        ready_timeout_s=600, extra_args=extra,
    )  # fmt: skip
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
    parser.add_argument("--encoder-engines", nargs="+", default=["reference"], choices=["reference", "vllm"])
    parser.add_argument("--service-args", default="", help="flags for every vLLM service, e.g. '--device cuda'")
    parser.add_argument("--check", action="store_true", help="exit 1 when EPD's tokens differ from vLLM unsplit's")
    ns = parser.parse_args()
    rows = []
    for family in ns.families:
        model = ensure_checkpoint(family, "tiny")
        theirs = unsplit_tokens(model, family)
        reference = {mix.name: reference_tokens(model, mix) for mix in mixes(family)}
        service_args = shlex.split(ns.service_args)
        for layout in ns.layouts:
            for encoder in ns.encoder_engines:
                if encoder == "vllm" and family == "qwen2_5_omni":
                    continue  # refused: vLLM's Omni tower crashes its CPU worker (docs/vllm.md)
                name = f"vllm-tokens-{family}-{layout.replace('/', '-')}-{encoder}"
                ours, up, ttft = epd(model, family, layout, encoder, ROOT / "var" / "run" / name, service_args)
                for mix, tokens in ours.items():
                    ref = theirs.get(mix, "missing")
                    same_ref = tokens == reference[mix]
                    rows.append((family, layout, encoder, mix, tokens == ref, same_ref, tokens, ref, ttft[mix]))
                print(f"{family}: {layout} ({encoder} encoder) stack up in {up:.0f} s", flush=True)
    print(
        "| family | layout | encoder | mix | == vLLM unsplit | == reference | EPD tokens | unsplit tokens | TTFT (ms) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for family, layout, encoder, mix, same, same_ref, tokens, ref, t in rows:
        yes = {True: "yes", False: "NO"}
        cells = [family, layout, encoder, mix, yes[same], yes[same_ref], tokens, ref, f"{t * 1e3:.0f}"]
        print("| " + " | ".join(map(str, cells)) + " |")
    if ns.check and not all(row[5] for row in rows):  # the reference runtime is the golden
        print(f"golden check FAILED: {sum(not row[5] for row in rows)} of {len(rows)} rows differ", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
