"""Per-family recipes for generated checkpoints: special tokens, chat template, config, hub names."""

from __future__ import annotations

from typing import Any

import torch

from libs.model.checkpoints import vl_specs
from libs.model.checkpoints.common import FamilySpec, rename_prefix, round_vocab

_OMNI_SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_bos|>", "<|vision_eos|>", "<|vision_pad|>",
    "<|IMAGE|>", "<|VIDEO|>",
]  # fmt: skip

_OMNI_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{%- endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{%- if message['content'] is string %}{{ message['content'] }}"
    "{%- else %}{%- for content in message['content'] %}"
    "{%- if content['type'] == 'image' %}<|vision_bos|><|IMAGE|><|vision_eos|>"
    "{%- elif content['type'] == 'video' %}<|vision_bos|><|VIDEO|><|vision_eos|>"
    "{%- elif content['type'] == 'audio' %}<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{%- elif content['type'] == 'text' %}{{ content['text'] }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "<|im_end|>\n"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)

_VISION_FILES_TINY: dict[str, dict[str, Any]] = {
    "preprocessor_config.json": {
        "image_processor_type": "Qwen2VLImageProcessor",
        "min_pixels": 28 * 28 * 4,
        "max_pixels": 28 * 28 * 16,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
    },
    "video_preprocessor_config.json": {
        "min_pixels": 28 * 28 * 4,
        "max_pixels": 28 * 28 * 4,
        "fps": 2.0,
        "max_frames": 8,
    },
}
_AUDIO_FEATURES = {
    "feature_extractor_type": "WhisperFeatureExtractor",
    "feature_size": 128,
    "sampling_rate": 16000,
    "hop_length": 160,
    "chunk_length": 30,
    "n_fft": 400,
    "padding_value": 0.0,
    "return_attention_mask": True,
}


# ---- Qwen2.5-Omni thinker ----------------------------------------------------------------------

_OMNI_SIZES: dict[str, dict[str, Any]] = {
    # Text head_dim 32 (= 64 / 2): vLLM's CPU attention has no kernel for 16 and kills its engine.
    # Tiny uses a low rope_theta, as the VL tiny recipes do (positions must visibly matter).
    "tiny": dict(hidden=64, inter=128, layers=2, heads=2, kv=2, v_depth=2, v_hidden=32, v_inter=64, v_heads=2,
                 a_layers=2, a_dim=32, a_ffn=64, a_heads=2, mrope=[4, 6, 6], theta=10000.0),
    "small": dict(hidden=768, inter=2048, layers=12, heads=12, kv=2, v_depth=8, v_hidden=384, v_inter=1024,
                  v_heads=6, a_layers=4, a_dim=384, a_ffn=1536, a_heads=6, mrope=[8, 12, 12], theta=1000000.0),
}  # fmt: skip


def _omni_build(size: str, ids: dict[str, int], tok_len: int, seed: int) -> tuple[dict[str, Any], torch.nn.Module]:
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniThinkerConfig
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniThinkerForConditionalGeneration

    s = _OMNI_SIZES[size]
    config_cls: Any = Qwen2_5OmniThinkerConfig
    thinker = config_cls(
        text_config=dict(
            vocab_size=round_vocab(tok_len), hidden_size=s["hidden"], intermediate_size=s["inter"],
            num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv"],
            max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
            initializer_range=0.1,
            rope_parameters={"rope_type": "default", "rope_theta": s["theta"], "mrope_section": s["mrope"]},
        ),
        vision_config=dict(
            depth=s["v_depth"], hidden_size=s["v_hidden"], intermediate_size=s["v_inter"], num_heads=s["v_heads"],
            out_hidden_size=s["hidden"], fullatt_block_indexes=[s["v_depth"] - 1], window_size=112,
            patch_size=14, temporal_patch_size=2, spatial_merge_size=2, initializer_range=0.1,
        ),
        audio_config=dict(
            num_mel_bins=128, encoder_layers=s["a_layers"], encoder_attention_heads=s["a_heads"],
            encoder_ffn_dim=s["a_ffn"], d_model=s["a_dim"], output_dim=s["hidden"], n_window=100,
            max_source_positions=1500, initializer_range=0.1,
        ),
        audio_token_index=ids["<|AUDIO|>"], image_token_index=ids["<|IMAGE|>"], video_token_index=ids["<|VIDEO|>"],
        audio_start_token_id=ids["<|audio_bos|>"], audio_end_token_id=ids["<|audio_eos|>"],
        vision_start_token_id=ids["<|vision_bos|>"], vision_end_token_id=ids["<|vision_eos|>"],
        user_token_id=ids["<|im_start|>"], position_id_per_seconds=25, seconds_per_chunk=2,
        initializer_range=0.1, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model_cls: Any = Qwen2_5OmniThinkerForConditionalGeneration
    model: torch.nn.Module = model_cls(thinker).eval()
    config = {
        "model_type": "qwen2_5_omni",
        "architectures": ["Qwen2_5OmniModel"],
        "enable_audio_output": False,
        "thinker_config": thinker.to_dict(),
    }
    return config, model


def _omni_hub_name(name: str) -> str:
    return rename_prefix(
        name,
        (
            ("model.language_model.", "thinker.model."),
            ("model.visual.", "thinker.visual."),
            ("model.audio_tower.", "thinker.audio_tower."),
            ("lm_head.", "thinker.lm_head."),
            # transformers < 5.2x keeps the towers and the text model at the top level
            ("audio_tower.", "thinker.audio_tower."),
            ("visual.", "thinker.visual."),
            ("model.", "thinker.model."),
        ),
    )


def _omni_files(size: str) -> dict[str, dict[str, Any]]:
    files: dict[str, dict[str, Any]] = {k: dict(v) for k, v in _VISION_FILES_TINY.items()}
    files["preprocessor_config.json"].update(_AUDIO_FEATURES)
    if size == "small":
        files["preprocessor_config.json"]["max_pixels"] = 28 * 28 * 256
        files["video_preprocessor_config.json"].update(max_pixels=28 * 28 * 64, max_frames=16)
    return files


FAMILY_SPECS: dict[str, FamilySpec] = {
    "qwen2_5_omni": FamilySpec(
        bpe_vocab=448,
        special_tokens=_OMNI_SPECIALS,
        chat_template=_OMNI_TEMPLATE,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        build=_omni_build,
        hub_name=_omni_hub_name,
        extra_files=_omni_files,
        # The released tokenizer config names these; the HF Omni processor (and vLLM) read them.
        named_tokens={
            "image_token": "<|IMAGE|>",
            "audio_token": "<|AUDIO|>",
            "video_token": "<|VIDEO|>",
            "vision_bos_token": "<|vision_bos|>",
            "vision_eos_token": "<|vision_eos|>",
            "audio_bos_token": "<|audio_bos|>",
            "audio_eos_token": "<|audio_eos|>",
        },
    ),
    **vl_specs.SPECS,
}
