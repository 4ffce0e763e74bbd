"""Qwen2.5-VL: window-attention vision tower (image + video), Qwen2 language model, M-RoPE with
video time from `seconds_per_grid`."""

from __future__ import annotations

import torch
from transformers import Qwen2_5_VLConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
    Qwen2_5_VisionTransformerPretrainedModel,
    Qwen2_5_VLTextModel,
)

from libs.model.families.qwen_vl import QwenVLAdapter
from libs.model.types import ItemLayout


class Qwen25VLAdapter(QwenVLAdapter):
    family = "qwen2_5_vl"
    config_class = Qwen2_5_VLConfig
    vision_class = Qwen2_5_VisionTransformerPretrainedModel
    text_class = Qwen2_5_VLTextModel

    def temporal_index(self, layout: ItemLayout) -> torch.Tensor:
        grid = self.grid(layout)
        if layout.video is None:
            return torch.zeros(grid.grid_t, dtype=torch.long)
        # transformers: (arange(t) * (tokens_per_second * second_per_grid_ts[i])).long(), in float32,
        # so truncation lands on the same integers.
        per_second = int(self.config.vision_config.tokens_per_second)
        interval = per_second * torch.tensor(layout.video.seconds_per_grid, dtype=torch.float32)
        return (torch.arange(grid.grid_t) * interval).long()
