"""Qwen2.5-VL checkpoints as they come from elsewhere load the same way: a flat hub config.json,
transformers-5 tensor names, tied embeddings (no lm_head tensor)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from libs.model.media import synthetic
from libs.model.types import ChatMessage, ChatRole, EncodedPart, MediaInput, Modality, SamplingParams, TextPart
from libs.runtime.encoder_runner import EncoderRunner
from libs.runtime.lm_runtime import LanguageModelRuntime
from libs.runtime.prefill_runner import PrefillRunner
from tests.support.engines import Engines

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _variant(source: Path, out: Path) -> Path:
    """`source` with a flat config (text fields at the top level, as released Qwen2.5-VL configs
    have them), transformers-5 tensor names and the output head tied to the embeddings."""
    shutil.copytree(source, out)
    config = json.loads((source / "config.json").read_text())
    text = config.pop("text_config")
    text.pop("model_type", None)
    config.update(text, tie_word_embeddings=True)
    (out / "config.json").write_text(json.dumps(config))
    renamed = {}
    for name, tensor in load_file(str(source / "model.safetensors")).items():
        if name.startswith("visual."):
            renamed["model." + name] = tensor
        elif name.startswith("model."):
            renamed["model.language_model." + name[len("model.") :]] = tensor
    save_file(renamed, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_flat_config_t5_names_tied_head(engines: Callable[[str], Engines], tmp_path: Path) -> None:
    original = engines("qwen2_5_vl")
    path = _variant(original.path, tmp_path / "variant")
    encoder, runtime = EncoderRunner(path), LanguageModelRuntime(path)
    assert runtime.adapter.text_config.hidden_size == original.runtime.adapter.text_config.hidden_size
    assert all(n.startswith("model.visual.") for n in encoder.checkpoint.loaded_names)
    assert all(n.startswith("model.language_model.") for n in runtime.checkpoint.loaded_names)
    head, embed = runtime.module.lm_head.weight, runtime.module.model.embed_tokens.weight  # type: ignore[union-attr]
    assert torch.equal(head, embed)

    image = MediaInput(Modality.IMAGE, synthetic.png_bytes(60, 90, seed=1))
    (item,) = encoder.encode([image])
    (same,) = original.encoder.encode([image])
    assert item.layout == same.layout and torch.equal(item.embeddings, same.embeddings)
    ask = [ChatMessage(ChatRole.USER, (EncodedPart(item), TextPart("what is it")))]
    result = PrefillRunner(runtime).prefill(ask, SamplingParams(max_tokens=2), return_logits=True)
    assert result.logits is not None and torch.isfinite(result.logits).all()
