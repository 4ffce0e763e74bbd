"""Generate a seeded random-weight checkpoint in the family's hub layout.

    python -m libs.engine.checkpoints --family qwen2_5_omni --size tiny [--out DIR] [--seed 0]

The layout (config.json, model.safetensors with hub tensor names, tokenizer files with the
family's special tokens and chat template, preprocessor configs) is what a real checkpoint has, so
the engine's loader handles both alike.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from libs.engine.checkpoints import specs
from libs.engine.checkpoints.tokenizer import train_tokenizer

FAMILIES = tuple(specs.FAMILY_SPECS)
SIZES = ("tiny", "small")
REPO_ROOT = Path(__file__).resolve().parents[3]


def default_dir(family: str, size: str) -> Path:
    return REPO_ROOT / "var" / "models" / f"{family}-{size}"


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def generate_checkpoint(family: str, size: str, out: Path, *, seed: int = 0) -> Path:
    spec = specs.FAMILY_SPECS[family]
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent if out.parent.exists() else None))
    try:
        tokenizer = train_tokenizer(
            tmp,
            vocab_size=spec.bpe_vocab,
            special_tokens=spec.special_tokens,
            chat_template=spec.chat_template,
            eos=spec.eos,
            pad=spec.pad,
        )
        ids = {token: int(tokenizer.convert_tokens_to_ids(token)) for token in spec.special_tokens}
        model_cfg, model = spec.build(size, ids, len(tokenizer), seed)
        tensors = {spec.hub_name(k): v.contiguous() for k, v in model.state_dict().items()}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _write_json(tmp / "config.json", model_cfg)
        for name, data in spec.extra_files(size).items():
            _write_json(tmp / name, data)
        eos_ids = [ids[spec.eos], ids[spec.pad]]
        _write_json(
            tmp / "generation_config.json",
            {"eos_token_id": eos_ids, "pad_token_id": ids[spec.pad], "do_sample": False},
        )
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():
            shutil.rmtree(out)
        tmp.chmod(0o755)
        tmp.rename(out)  # atomic: a half-written checkpoint is never visible under `out`
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


def ensure_checkpoint(family: str, size: str = "tiny", *, seed: int = 0) -> Path:
    out = default_dir(family, size)
    if not (out / "model.safetensors").is_file():
        generate_checkpoint(family, size, out, seed=seed)
    return out


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=FAMILIES, required=True)
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = args.out or default_dir(args.family, args.size)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    path = generate_checkpoint(args.family, args.size, out, seed=args.seed)
    print(path)
