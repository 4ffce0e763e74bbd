"""Checkpoint recipes for Qwen2.5-VL and Qwen3-VL (image + video): special tokens, chat templates,
configs and hub tensor names as the released checkpoints have them."""

from __future__ import annotations

from typing import Any

import torch

from libs.model.checkpoints.common import FamilySpec, rename_prefix, round_vocab

VL_SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>",
]  # fmt: skip


def vl_template(default_system: str | None) -> str:
    """The released templates' shape: one <|vision_start|><|X_pad|><|vision_end|> per item; the
    processor (here: the adapter) expands the pad token."""
    system = (
        "{%- if messages[0]['role'] != 'system' %}<|im_start|>system\n" + default_system + "<|im_end|>\n{% endif %}"
        if default_system
        else ""
    )
    return (
        system + "{%- for message in messages %}<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{%- else %}{%- for content in message['content'] %}"
        "{%- if content['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
        "{%- elif content['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
        "{%- elif content['type'] == 'text' %}{{ content['text'] }}"
        "{%- endif %}{%- endfor %}{%- endif %}<|im_end|>\n"
        "{% endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


def _token_ids(ids: dict[str, int]) -> dict[str, int]:
    return dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )


def _text(s: dict[str, Any], tok_len: int) -> dict[str, Any]:
    return dict(
        vocab_size=round_vocab(tok_len), hidden_size=s["hidden"], intermediate_size=s["inter"],
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv"],
        max_position_embeddings=32768, rms_norm_eps=1e-6, initializer_range=0.1,
    )  # fmt: skip


def _instantiate(model_cls: Any, config: Any, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model: torch.nn.Module = model_cls(config).eval()
    return model


# Tiny sizes use a low rope_theta: with a small head_dim the real theta leaves the h/w rotary sections
# almost static, and the negative controls (grid swapped) need positions to visibly matter. Text
# head_dim is 32: vLLM's CPU attention has no kernel for 16 (the engine dies at the first forward).

# ---- Qwen2.5-VL ------------------------------------------------------------------------------------

_QWEN25_SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden=64, inter=128, layers=2, heads=2, kv=2, mrope=[4, 6, 6], theta=10000.0,
                 v_depth=2, v_hidden=32, v_inter=64, v_heads=2),
    "small": dict(hidden=768, inter=2048, layers=12, heads=12, kv=2, mrope=[8, 12, 12], theta=1000000.0,
                  v_depth=8, v_hidden=384, v_inter=1024, v_heads=6),
}  # fmt: skip


def _qwen25_build(size: str, ids: dict[str, int], tok_len: int, seed: int) -> tuple[dict[str, Any], torch.nn.Module]:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    s = _QWEN25_SIZES[size]
    text = _text(s, tok_len)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": s["theta"], "mrope_section": s["mrope"]}
    text.update(bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"])  # defaults are the real vocab's
    config_cls: Any = Qwen2_5_VLConfig
    config = config_cls(
        text_config=text,
        vision_config=dict(
            depth=s["v_depth"], hidden_size=s["v_hidden"], intermediate_size=s["v_inter"], num_heads=s["v_heads"],
            out_hidden_size=s["hidden"], fullatt_block_indexes=[s["v_depth"] - 1], window_size=112,
            patch_size=14, temporal_patch_size=2, spatial_merge_size=2, tokens_per_second=2, initializer_range=0.1,
        ),
        tie_word_embeddings=False, **_token_ids(ids),
    )  # fmt: skip
    model = _instantiate(Qwen2_5_VLForConditionalGeneration, config, seed)
    return {**config.to_dict(), "architectures": ["Qwen2_5_VLForConditionalGeneration"]}, model


def _qwen25_hub_name(name: str) -> str:
    # Released Qwen2.5-VL checkpoints predate the transformers-5 layout: visual.*, model.*, lm_head.*
    return rename_prefix(
        name, (("model.language_model.", "model."), ("model.visual.", "visual."), ("lm_head.", "lm_head."))
    )


def _qwen25_files(size: str) -> dict[str, dict[str, Any]]:
    factor = 28
    image_max, video_max, frames = (16, 4, 8) if size == "tiny" else (256, 64, 16)
    mean, std = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
    return {
        "preprocessor_config.json": {
            "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
            "min_pixels": factor * factor * 4, "max_pixels": factor * factor * image_max, "patch_size": 14,
            "temporal_patch_size": 2, "merge_size": 2, "image_mean": mean, "image_std": std,
        },
        "video_preprocessor_config.json": {
            "min_pixels": factor * factor * 4, "max_pixels": factor * factor * video_max, "fps": 2.0,
            "max_frames": frames,
        },
    }  # fmt: skip


# ---- Qwen3-VL --------------------------------------------------------------------------------------

_QWEN3_SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden=64, inter=128, layers=3, heads=4, kv=2, head_dim=32, mrope=[4, 6, 6], theta=10000.0,
                 v_depth=3, v_hidden=32, v_inter=64, v_heads=2, v_pos=16, deepstack=[0, 1]),
    "small": dict(hidden=768, inter=2048, layers=12, heads=12, kv=2, head_dim=64, mrope=[12, 10, 10], theta=5000000.0,
                  v_depth=8, v_hidden=384, v_inter=1024, v_heads=6, v_pos=256, deepstack=[1, 3, 5]),
}  # fmt: skip


def _qwen3_build(size: str, ids: dict[str, int], tok_len: int, seed: int) -> tuple[dict[str, Any], torch.nn.Module]:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    s = _QWEN3_SIZES[size]
    text = _text(s, tok_len)
    text["head_dim"] = s["head_dim"]
    text["rope_parameters"] = {
        "rope_type": "default", "rope_theta": s["theta"], "mrope_section": s["mrope"], "mrope_interleaved": True,
    }  # fmt: skip
    config_cls: Any = Qwen3VLConfig
    config = config_cls(
        text_config=text,
        vision_config=dict(
            depth=s["v_depth"], hidden_size=s["v_hidden"], intermediate_size=s["v_inter"], num_heads=s["v_heads"],
            out_hidden_size=s["hidden"], num_position_embeddings=s["v_pos"], deepstack_visual_indexes=s["deepstack"],
            patch_size=16, temporal_patch_size=2, spatial_merge_size=2, initializer_range=0.1,
        ),
        tie_word_embeddings=False, **_token_ids(ids),
    )  # fmt: skip
    model = _instantiate(Qwen3VLForConditionalGeneration, config, seed)
    return {**config.to_dict(), "architectures": ["Qwen3VLForConditionalGeneration"]}, model


def _qwen3_hub_name(name: str) -> str:
    return name  # released Qwen3-VL checkpoints already use model.visual.* / model.language_model.*


def _qwen3_files(size: str) -> dict[str, dict[str, Any]]:
    factor = 32
    image_max, video_max, frames = (16, 4, 8) if size == "tiny" else (256, 64, 16)
    return {
        "preprocessor_config.json": {
            "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3VLProcessor",
            "size": {"shortest_edge": factor * factor * 4, "longest_edge": factor * factor * image_max},
            "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        },
        "video_preprocessor_config.json": {
            "video_processor_type": "Qwen3VLVideoProcessor",
            "size": {"shortest_edge": factor * factor * 4, "longest_edge": factor * factor * video_max},
            "fps": 2.0, "max_frames": frames, "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        },
    }  # fmt: skip


SPECS: dict[str, FamilySpec] = {
    "qwen2_5_vl": FamilySpec(
        bpe_vocab=448,
        special_tokens=VL_SPECIALS,
        chat_template=vl_template("You are a helpful assistant."),
        eos="<|im_end|>",
        pad="<|endoftext|>",
        build=_qwen25_build,
        hub_name=_qwen25_hub_name,
        extra_files=_qwen25_files,
    ),
    "qwen3_vl": FamilySpec(
        bpe_vocab=448,
        special_tokens=VL_SPECIALS,
        chat_template=vl_template(None),
        eos="<|im_end|>",
        pad="<|endoftext|>",
        build=_qwen3_build,
        hub_name=_qwen3_hub_name,
        extra_files=_qwen3_files,
    ),
}
