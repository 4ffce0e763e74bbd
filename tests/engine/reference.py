"""The colocated reference: the transformers model class with all weights, and its own generate()."""

from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationConfig

from libs.engine.checkpoint import Checkpoint
from libs.engine.families import adapter_for
from libs.engine.families.base import PreparedItem
from libs.engine.types import Modality


def load_reference(model_path: str) -> Any:
    """Full transformers model for the checkpoint, weights renamed with the adapter's own maps."""
    checkpoint = Checkpoint(model_path)
    adapter = adapter_for(checkpoint)
    family = adapter.family
    if family == "qwen2_5_omni":
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
            Qwen2_5OmniThinkerForConditionalGeneration as cls,
        )
    elif family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLForConditionalGeneration as cls
    else:
        from transformers import Qwen3VLForConditionalGeneration as cls

    def rename(name: str) -> str | None:
        if (local := adapter.encoder_tensor_name(name)) is not None:
            return "model." + local
        if (local := adapter.lm_tensor_name(name)) is not None:
            if local.startswith("lm_head."):
                return local
            return "model.language_model." + local[len("model.") :]
        return None

    model = cls(adapter.config).eval()
    tensors = checkpoint.load(rename)
    if not any(k.startswith("model.language_model.") for k in model.state_dict()):
        # transformers < 5.2x (Qwen2.5-Omni thinker): towers and text model at the top level
        flat = (
            ("model.language_model.", "model."),
            ("model.visual.", "visual."),
            ("model.audio_tower.", "audio_tower."),
        )
        tensors = {
            next((new + k[len(old) :] for old, new in flat if k.startswith(old)), k): v for k, v in tensors.items()
        }
    result = model.load_state_dict(tensors, strict=False)
    assert not result.missing_keys and not result.unexpected_keys, result
    # As from_pretrained would: stop on the checkpoint's end-of-sequence ids, like the runners do.
    model.generation_config = GenerationConfig.from_pretrained(model_path)
    return model


def reference_inputs(input_ids: list[int], prepared: list[PreparedItem], model: Any = None) -> dict[str, Any]:
    """generate() kwargs from our prompt ids and the preprocessed items (in prompt order), named as
    `model`'s class wants them (no model: the Omni thinker's names)."""
    ids = torch.tensor([input_ids])
    kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": torch.ones(1, len(input_ids), dtype=torch.long)}
    model_type = model.config.model_type if model is not None else "qwen2_5_omni"
    if model_type in ("qwen2_5_vl", "qwen3_vl"):
        # What the processors return next to input_ids: 1 on image rows, 2 on video rows.
        cfg = model.config
        kwargs["mm_token_type_ids"] = (ids == cfg.image_token_id).int() + 2 * (ids == cfg.video_token_id).int()
    images = [p for p in prepared if p.layout.modality is Modality.IMAGE]
    videos = [p for p in prepared if p.layout.modality is Modality.VIDEO]
    audios = [p for p in prepared if p.layout.modality is Modality.AUDIO]
    if images:
        kwargs["pixel_values"] = torch.cat([p.inputs["pixel_values"] for p in images])
        kwargs["image_grid_thw"] = torch.tensor(
            [[p.layout.image.grid_t, p.layout.image.grid_h, p.layout.image.grid_w] for p in images if p.layout.image]
        )
    if videos:
        kwargs["pixel_values_videos"] = torch.cat([p.inputs["pixel_values"] for p in videos])
        kwargs["video_grid_thw"] = torch.tensor(
            [[p.layout.video.grid_t, p.layout.video.grid_h, p.layout.video.grid_w] for p in videos if p.layout.video]
        )
        seconds = torch.tensor([p.layout.video.seconds_per_grid for p in videos if p.layout.video])
        if model_type == "qwen2_5_vl":
            kwargs["second_per_grid_ts"] = seconds
        elif model_type != "qwen3_vl":  # Qwen3-VL takes time from the timestamp text instead
            kwargs["video_second_per_grid"] = seconds
    if audios:
        width = max(p.inputs["input_features"].shape[1] for p in audios)
        feats = torch.zeros(len(audios), audios[0].inputs["input_features"].shape[0], width)
        mask = torch.zeros(len(audios), width, dtype=torch.long)
        for i, p in enumerate(audios):
            n = p.inputs["input_features"].shape[1]
            feats[i, :, :n] = p.inputs["input_features"]
            mask[i, :n] = 1
        kwargs["input_features"] = feats
        kwargs["feature_attention_mask"] = mask
    return kwargs


def reference_generate(model: Any, kwargs: dict[str, Any], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    with torch.inference_mode():
        out = model.generate(
            **kwargs,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    prompt_len = kwargs["input_ids"].shape[1]
    return out.sequences[0, prompt_len:].tolist(), [step[0].float() for step in out.logits]
