"""Test-only writer of CTranslate2 `model.bin` files, after `ModelSpec._serialize` in CTranslate2's
`python/ctranslate2/specs/model_spec.py`, and of a WhisperSpec the way CTranslate2's transformers
converter (`WhisperLoader`) builds one: q/k/v fused for self-attention, k/v for cross-attention, a
zero bias where Whisper's k projections have none, the output projection an alias of the
embeddings. Lets the reader and the converter be checked against a model whose weights we know."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch

TYPE_IDS = {"float32": 0, "int8": 1, "int16": 2, "int32": 3, "float16": 4}


def _string(value: str) -> bytes:
    raw = value.encode()
    return struct.pack("<H", len(raw) + 1) + raw + b"\0"


def serialize(
    variables: dict[str, np.ndarray], aliases: dict[str, str], *, spec: str = "WhisperSpec", revision: int = 3
) -> bytes:
    out = [struct.pack("<I", 6), _string(spec), struct.pack("<I", revision), struct.pack("<I", len(variables))]
    for name, value in sorted(variables.items()):
        out.append(_string(name) + struct.pack("<B", value.ndim))
        out += [struct.pack("<I", d) for d in value.shape]
        out.append(struct.pack("<B", TYPE_IDS[value.dtype.name]) + struct.pack("<I", value.nbytes) + value.tobytes())
    out.append(struct.pack("<I", len(aliases)))
    out += [_string(alias) + _string(target) for alias, target in sorted(aliases.items())]
    return b"".join(out)


def whisper_variables(state: dict[str, torch.Tensor], config: Any, dtype: str = "float16") -> dict[str, np.ndarray]:
    """A WhisperForConditionalGeneration state dict as CTranslate2's WhisperSpec variables."""

    def arr(name: str) -> np.ndarray:
        return state[name].detach().float().numpy().astype(dtype)

    def zeros(n: int) -> np.ndarray:
        return np.zeros(n, dtype=dtype)

    v: dict[str, np.ndarray] = {}

    def attention(ct2: str, hf: str, cross: bool) -> None:
        q, k, val = (f"{hf}.{p}_proj" for p in "qkv")
        if cross:
            v[f"{ct2}/linear_0/weight"], v[f"{ct2}/linear_0/bias"] = arr(f"{q}.weight"), arr(f"{q}.bias")
            v[f"{ct2}/linear_1/weight"] = np.concatenate([arr(f"{k}.weight"), arr(f"{val}.weight")])
            v[f"{ct2}/linear_1/bias"] = np.concatenate([zeros(config.d_model), arr(f"{val}.bias")])
            out = f"{ct2}/linear_2"
        else:
            v[f"{ct2}/linear_0/weight"] = np.concatenate([arr(f"{q}.weight"), arr(f"{k}.weight"), arr(f"{val}.weight")])
            v[f"{ct2}/linear_0/bias"] = np.concatenate([arr(f"{q}.bias"), zeros(config.d_model), arr(f"{val}.bias")])
            out = f"{ct2}/linear_1"
        v[f"{out}/weight"], v[f"{out}/bias"] = arr(f"{hf}.out_proj.weight"), arr(f"{hf}.out_proj.bias")

    def norm(ct2: str, hf: str) -> None:
        v[f"{ct2}/gamma"], v[f"{ct2}/beta"] = arr(f"{hf}.weight"), arr(f"{hf}.bias")

    def layer(ct2: str, hf: str, decoder: bool) -> None:
        attention(f"{ct2}/self_attention", f"{hf}.self_attn", cross=False)
        norm(f"{ct2}/self_attention/layer_norm", f"{hf}.self_attn_layer_norm")
        if decoder:
            attention(f"{ct2}/attention", f"{hf}.encoder_attn", cross=True)
            norm(f"{ct2}/attention/layer_norm", f"{hf}.encoder_attn_layer_norm")
        for i, fc in enumerate(("fc1", "fc2")):
            v[f"{ct2}/ffn/linear_{i}/weight"], v[f"{ct2}/ffn/linear_{i}/bias"] = (
                arr(f"{hf}.{fc}.weight"),
                arr(f"{hf}.{fc}.bias"),
            )
        norm(f"{ct2}/ffn/layer_norm", f"{hf}.final_layer_norm")

    for conv in ("conv1", "conv2"):
        v[f"encoder/{conv}/weight"], v[f"encoder/{conv}/bias"] = (
            arr(f"model.encoder.{conv}.weight"),
            arr(f"model.encoder.{conv}.bias"),
        )
    v["encoder/position_encodings/encodings"] = arr("model.encoder.embed_positions.weight")
    for i in range(config.encoder_layers):
        layer(f"encoder/layer_{i}", f"model.encoder.layers.{i}", decoder=False)
    norm("encoder/layer_norm", "model.encoder.layer_norm")
    v["encoder/num_heads"] = np.array(config.encoder_attention_heads, dtype=np.int16)
    v["decoder/embeddings/weight"] = arr("model.decoder.embed_tokens.weight")
    v["decoder/projection/weight"] = arr("model.decoder.embed_tokens.weight")  # aliased on save
    v["decoder/position_encodings/encodings"] = arr("model.decoder.embed_positions.weight")
    for i in range(config.decoder_layers):
        layer(f"decoder/layer_{i}", f"model.decoder.layers.{i}", decoder=True)
    norm("decoder/layer_norm", "model.decoder.layer_norm")
    v["decoder/num_heads"] = np.array(config.decoder_attention_heads, dtype=np.int16)
    for flag, value in (("activation", 3), ("alibi", 0), ("pre_norm", 1), ("scale_embeddings", 0)):
        v[f"decoder/{flag}"] = np.array(value, dtype=np.int8)
    v["decoder/alignment_heads"] = np.array(1, dtype=np.int16)
    v["decoder/alignment_layer"] = np.array(-1, dtype=np.int16)
    return v


def write_whisper_ct2(directory: Path, model: Any, tokenizer_json: Path, dtype: str = "float16") -> Path:
    """A CTranslate2 model directory (model.bin, config.json, tokenizer.json) for `model`."""
    import json
    import shutil

    directory.mkdir(parents=True, exist_ok=True)
    variables = whisper_variables(model.state_dict(), model.config, dtype)
    del variables["decoder/projection/weight"]
    aliases = {"decoder/projection/weight": "decoder/embeddings/weight"}
    (directory / "model.bin").write_bytes(serialize(variables, aliases))
    gen = model.generation_config
    config = {
        "suppress_ids": list(gen.suppress_tokens),
        "suppress_ids_begin": list(gen.begin_suppress_tokens),
        "lang_ids": [],
        "alignment_heads": [[1, 0]],
    }
    (directory / "config.json").write_text(json.dumps(config))
    shutil.copyfile(tokenizer_json, directory / "tokenizer.json")
    return directory
