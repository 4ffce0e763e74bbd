"""The colocated reference: the transformers model class with all weights and its own generate(),
fed by the family's own transformers processor (`hf_reference.py`)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig

from libs.model.checkpoint import Checkpoint
from libs.model.families import adapter_for
from tests.support.hf_reference import RefItem, reference_batch
from tests.support.mixes import Mix


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
    return use_trained_mrope(model) if family == "qwen2_5_vl" else model


# What the family processors return that generate() takes (the rest, e.g. video_metadata, is not an input).
MODEL_INPUTS = (
    "input_ids",
    "attention_mask",
    "mm_token_type_ids",
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "second_per_grid_ts",
    "video_second_per_grid",
    "input_features",
    "feature_attention_mask",
)


def media_suffix(data: bytes) -> str:
    """File extension for the path-based reference loaders (they pick a decoder by it)."""
    if data[4:8] == b"ftyp":
        return "mp4"
    if data[:4] == b"RIFF":
        return "wav"
    if data[:4] == b"fLaC":
        return "flac"
    if data[:4] == b"OggS":
        return "ogg"
    if data[:3] == b"\xff\xd8\xff":
        return "jpg"
    return "png"


def reference_inputs(model_path: str | Path, mix: Mix) -> dict[str, Any]:
    """generate() kwargs for a mix, made by the family's own transformers processor from the media
    bytes and the tokenizer's chat template (`hf_reference.reference_batch`), not by the project."""
    parts = [
        part
        if isinstance(part, str)
        else RefItem(
            mix.media[part].modality, mix.media[part].data, media_suffix(mix.media[part].data), mix.media[part].options
        )
        for part in mix.parts
    ]
    batch = reference_batch(Path(model_path), parts)
    return {name: batch[name] for name in MODEL_INPUTS if name in batch}


def use_trained_mrope(model: Any) -> Any:
    """Qwen2.5-VL: text after a vision item resumes at the item's largest position + 1, as in the
    original implementation (transformers 4.x `get_rope_index`, vLLM), not at start + max(merged h,
    merged w) as transformers 5.x does (docs/runtime.md, "Preprocessing decisions"). Vision positions
    themselves are 5.x's own `get_vision_position_ids`. Batch of one, no padding (as the tests use)."""
    inner = model.model
    vision = model.config.vision_config

    def get_rope_index(
        input_ids: torch.Tensor,
        mm_token_type_ids: torch.Tensor,
        image_grid_thw: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        second_per_grid_ts: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert input_ids.shape[0] == 1 and (attention_mask is None or bool(attention_mask.all()))
        grids = {
            1: iter(image_grid_thw if image_grid_thw is not None else []),
            2: iter(video_grid_thw if video_grid_thw is not None else []),
        }
        seconds = iter(second_per_grid_ts if second_per_grid_ts is not None else [])
        pieces, current = [], 0
        for kind, group in itertools.groupby(mm_token_type_ids[0].tolist()):
            count = len(list(group))
            if kind == 0:
                pieces.append(torch.arange(count).view(1, -1).expand(3, -1) + current)
                current += count
                continue
            interval = vision.tokens_per_second * next(seconds, 1) if kind == 2 else 1
            positions = inner.get_vision_position_ids(
                current, next(grids[kind]), 1, vision.spatial_merge_size, interval
            )
            pieces.append(positions)
            current = int(positions.max()) + 1
        ids = torch.cat(pieces, dim=1).view(3, 1, -1)
        return ids, torch.tensor([[int(ids.max()) + 1 - input_ids.shape[1]]])

    inner.get_rope_index = get_rope_index
    return model


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
