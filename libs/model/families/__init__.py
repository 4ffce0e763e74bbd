"""Model-family adapters: what each checkpoint family needs beyond the generic runners."""

from __future__ import annotations

from libs.model.checkpoint import Checkpoint
from libs.model.errors import CheckpointError
from libs.model.families.base import FamilyAdapter


def adapter_for(checkpoint: Checkpoint) -> FamilyAdapter:
    """Pick the adapter from config.json's model_type."""
    model_type = checkpoint.config.get("model_type", "")
    if model_type in ("qwen2_5_omni", "qwen2_5_omni_thinker"):
        from libs.model.families.qwen2_5_omni import Qwen25OmniAdapter

        return Qwen25OmniAdapter(checkpoint)
    if model_type == "qwen2_5_vl":
        from libs.model.families.qwen2_5_vl import Qwen25VLAdapter

        return Qwen25VLAdapter(checkpoint)
    if model_type == "whisper":
        from libs.model.families.whisper import WhisperAdapter

        return WhisperAdapter(checkpoint)
    if model_type == "qwen3_vl":
        from libs.model.families.qwen3_vl import Qwen3VLAdapter

        return Qwen3VLAdapter(checkpoint)
    raise CheckpointError(f"unsupported model_type {model_type!r}", field="model_path")


__all__ = ["FamilyAdapter", "adapter_for"]
