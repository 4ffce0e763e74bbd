"""Generated tiny checkpoints run on vLLM's CPU backend: text head_dim >= 32 (16 kills its engine)
and the Omni tokenizer names the special tokens vLLM's processor reads; a checkpoint made by an
older recipe is regenerated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from libs.model.checkpoints import FAMILIES, ensure_checkpoint
from libs.model.checkpoints import generate as gen

pytestmark = pytest.mark.integration


def _text_config(path: Path) -> dict[str, object]:
    config = json.loads((path / "config.json").read_text())
    config = config.get("thinker_config", config)
    return dict(config.get("text_config", config))


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_text_head_dim_is_one_vllm_cpu_supports(family: str) -> None:
    text = _text_config(ensure_checkpoint(family, "tiny"))
    head_dim = text.get("head_dim") or int(text["hidden_size"]) // int(text["num_attention_heads"])  # type: ignore[call-overload]
    assert head_dim in (32, 64, 80, 96, 112, 128), head_dim


def test_omni_tokenizer_names_its_special_tokens() -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_checkpoint("qwen2_5_omni", "tiny")))
    assert (tokenizer.image_token, tokenizer.audio_token, tokenizer.video_token) == (
        "<|IMAGE|>",
        "<|AUDIO|>",
        "<|VIDEO|>",
    )
    assert tokenizer.convert_tokens_to_ids(tokenizer.vision_bos_token) == tokenizer.convert_tokens_to_ids(
        "<|vision_bos|>"
    )


def test_a_checkpoint_of_another_recipe_is_regenerated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(gen, "default_dir", lambda family, size: tmp_path / f"{family}-{size}")
    path = ensure_checkpoint("qwen2_5_vl", "tiny")
    stamp = path / gen.RECIPE_FILE
    assert json.loads(stamp.read_text())["fingerprint"] == gen.recipe_fingerprint("qwen2_5_vl", "tiny", 0)
    before = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_checkpoint("qwen2_5_vl", "tiny") == path  # current: kept
    assert (path / "model.safetensors").stat().st_mtime_ns == before
    stamp.write_text(json.dumps({"fingerprint": "an older recipe"}))
    ensure_checkpoint("qwen2_5_vl", "tiny")
    assert json.loads(stamp.read_text())["fingerprint"] == gen.recipe_fingerprint("qwen2_5_vl", "tiny", 0)
