"""Qwen3-VL: vision tower with deepstack (features of early vision layers, added to the hidden
states of the first language-model layers at the visual positions), Qwen3 language model with
interleaved M-RoPE, and video frames separated by "<t seconds>" timestamp text."""

from __future__ import annotations

from typing import Any

import torch
from transformers import Qwen3VLConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextModel, Qwen3VLVisionModel

from libs.model.errors import EmbeddingMismatchError
from libs.model.families.base import Expansion, PlacedItem, PreparedItem
from libs.model.families.qwen_vision import vision_position_offsets
from libs.model.families.qwen_vl import QwenVLAdapter
from libs.model.types import ItemLayout, Modality

VISUAL_POS_MASKS = "visual_pos_masks"


class Qwen3VLAdapter(QwenVLAdapter):
    family = "qwen3_vl"
    config_class = Qwen3VLConfig
    vision_class = Qwen3VLVisionModel
    text_class = Qwen3VLTextModel
    mean_patch_times = True  # the Qwen3-VL processor stamps a frame pair with its mean time
    video_style = "qwen3_vl"

    @property
    def deepstack_names(self) -> tuple[str, ...]:
        return tuple(f"deepstack.{i}" for i in range(len(self.config.vision_config.deepstack_visual_indexes)))

    def embedding_extra_names(self, modality: Modality) -> tuple[str, ...]:
        return self.deepstack_names

    # ---- prompt: per frame "<t seconds><|vision_start|> rows <|vision_end|>" ----
    def expand_placeholder(self, layout: ItemLayout, placeholder_id: int, tokenizer: Any) -> Expansion:
        video = layout.video
        if video is None:
            return super().expand_placeholder(layout, placeholder_id, tokenizer)
        self.grid(layout)
        if len(video.grid_timestamps_s) != video.grid_t:
            raise EmbeddingMismatchError(
                f"{len(video.grid_timestamps_s)} timestamps for grid_t {video.grid_t}", field="layout.video"
            )
        start, end = self.config.vision_start_token_id, self.config.vision_end_token_id
        rows = video.grid_h * video.grid_w // self.merge_size**2
        tokens: list[int] = []
        spans: list[tuple[int, int]] = []
        for seconds in video.grid_timestamps_s:
            tokens += tokenizer.encode(f"<{seconds:.1f} seconds>", add_special_tokens=False)
            tokens.append(start)
            spans.append((len(tokens), rows))
            tokens += [placeholder_id] * rows
            tokens.append(end)
        # The template wraps the placeholder in start/end; the per-frame pairs replace that pair.
        return Expansion(tokens, tuple(spans), absorb=(start, end))

    # ---- media ----
    def encode(
        self, encoder: torch.nn.Module, modality: Modality, items: list[PreparedItem]
    ) -> list[dict[str, torch.Tensor]]:
        counts = [item.layout.placeholder_token_count for item in items]
        out = self.tower(encoder, items)
        if out.pooler_output.shape[0] != sum(counts):
            raise EmbeddingMismatchError(f"tower produced {out.pooler_output.shape[0]} rows, expected {sum(counts)}")
        results: list[dict[str, torch.Tensor]] = [
            {"embeddings": part.contiguous()} for part in torch.split(out.pooler_output, counts)
        ]
        for name, feature in zip(self.deepstack_names, out.deepstack_features, strict=True):
            for result, part in zip(results, torch.split(feature, counts), strict=True):
                result[name] = part.contiguous()
        return results

    # ---- positions: each video frame is its own (1, h, w) grid between timestamp text ----
    def mrope_spans(self, placed: PlacedItem) -> list[tuple[int, torch.Tensor]]:
        grid = self.grid(placed.layout)
        frame = vision_position_offsets(1, grid.grid_h, grid.grid_w, self.merge_size, torch.zeros(1, dtype=torch.long))
        return [(start, frame) for start, _ in placed.row_spans()]

    # ---- deepstack ----
    def prefill_extras(
        self, items: list[PlacedItem], tensors: list[dict[str, torch.Tensor]], length: int
    ) -> dict[str, torch.Tensor] | None:
        """The visual positions of the prompt and, per deepstack layer, their rows in position order."""
        if not items:
            return None
        mask = torch.zeros(1, length, dtype=torch.bool)
        rows: dict[str, list[torch.Tensor]] = {name: [] for name in self.deepstack_names}
        for placed, item_tensors in sorted(zip(items, tensors, strict=True), key=lambda p: p[0].start):
            row = 0
            for start, count in placed.row_spans():
                mask[0, start : start + count] = True
                for name in self.deepstack_names:
                    rows[name].append(item_tensors[name][row : row + count])
                row += count
        return {VISUAL_POS_MASKS: mask, **{name: torch.cat(parts) for name, parts in rows.items()}}

    def lm_kwargs(self, extras: dict[str, torch.Tensor] | None) -> dict[str, Any]:
        if not extras:
            return {}
        return {
            "visual_pos_masks": extras[VISUAL_POS_MASKS],
            "deepstack_visual_embeds": [extras[name] for name in self.deepstack_names],
        }
