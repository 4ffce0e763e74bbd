"""What Qwen2.5-VL and Qwen3-VL share: one vision tower for images and video, a decoder-only
language model, hub and transformers-5 tensor names, and M-RoPE where text after a vision item
resumes at its largest position + 1 (the original implementation and vLLM; `build_mrope`)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from libs.model.checkpoint import Checkpoint
from libs.model.errors import EmbeddingMismatchError
from libs.model.families.base import Expansion, FamilyAdapter, PlacedItem, PreparedItem
from libs.model.families.causal_lm import CausalLM, strip_prefixes
from libs.model.families.qwen_vision import (
    QwenVisionPreprocessor,
    VideoPixels,
    build_mrope,
    video_layout,
    vision_position_offsets,
)
from libs.model.media import synthetic
from libs.model.media.limits import MediaLimits
from libs.model.types import ImageLayout, ItemLayout, MediaInput, Modality, VideoLayout

# Released checkpoints: Qwen2.5-VL visual.* / model.*; Qwen3-VL (and transformers-5 saves)
# model.visual.* / model.language_model.*. Encoder names are matched first: "model." is a prefix of both.
_VISUAL = ("model.visual.", "visual.")
_LM = ("model.language_model.", "model.")
_HEAD = ("lm_head.",)


class QwenVLAdapter(FamilyAdapter):
    modalities = frozenset({Modality.IMAGE, Modality.VIDEO})
    config_class: Any
    vision_class: Any
    text_class: Any
    mean_patch_times = False  # grid_timestamps_s: first frame of each temporal patch
    video_style = "qwen2_vl"  # which transformers video processor the family defaults to

    def __init__(self, checkpoint: Checkpoint) -> None:
        super().__init__(checkpoint)
        self.config: Any = self.config_class.from_dict(checkpoint.config)
        vision: Any = self.config.vision_config
        self.merge_size = int(vision.spatial_merge_size)
        self.vision = QwenVisionPreprocessor(checkpoint, vision, video_style=self.video_style)

    # ---- weights ----
    def encoder_tensor_name(self, name: str) -> str | None:
        rest = strip_prefixes(name, _VISUAL)
        return None if rest is None else "visual." + rest

    def lm_tensor_name(self, name: str) -> str | None:
        if self.encoder_tensor_name(name) is not None:
            return None
        if (rest := strip_prefixes(name, _HEAD)) is not None:
            return "lm_head." + rest
        if (rest := strip_prefixes(name, _LM)) is not None:
            return "model." + rest
        return None

    def build_encoder(self) -> torch.nn.Module:
        return torch.nn.ModuleDict({"visual": self.vision_class._from_config(self.config.vision_config)})

    def build_language_model(self) -> torch.nn.Module:
        text = self.config.text_config
        return CausalLM(self.text_class._from_config(text), text.hidden_size, text.vocab_size)

    def finish_language_model(self, module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        if "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors:
            tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]  # tied embeddings

    @property
    def hidden_size(self) -> int:
        return int(self.config.text_config.hidden_size)

    @property
    def text_config(self) -> Any:
        return self.config.text_config

    # ---- prompt ----
    def placeholder_token(self, modality: Modality) -> str:
        return {Modality.IMAGE: "<|image_pad|>", Modality.VIDEO: "<|video_pad|>"}[modality]

    def content_type(self, modality: Modality) -> str:
        return modality.value

    def grid(self, layout: ItemLayout) -> ImageLayout | VideoLayout:
        """The item's grid, checked against its placeholder count (a grid that does not fit the
        rows would silently misplace positions)."""
        grid = layout.image or layout.video
        assert grid is not None  # ItemLayout.check() ran
        if grid.grid_t * grid.grid_h * grid.grid_w != layout.placeholder_token_count * self.merge_size**2:
            raise EmbeddingMismatchError(
                f"grid {grid.grid_t}x{grid.grid_h}x{grid.grid_w} does not give "
                f"{layout.placeholder_token_count} merged rows",
                field="layout.detail",
            )
        return grid

    def expand_placeholder(self, layout: ItemLayout, placeholder_id: int, tokenizer: Any) -> Expansion:
        self.grid(layout)
        return super().expand_placeholder(layout, placeholder_id, tokenizer)

    # ---- media ----
    def preprocess(self, media: MediaInput, mm_hash: str, limits: MediaLimits) -> PreparedItem:
        if media.modality is Modality.IMAGE:
            pixels, image = self.vision.image(media.data, media.options, limits)
            return PreparedItem(self.image_item(media, mm_hash, image), {"pixel_values": pixels})
        clip = self.vision.video(media.data, media.options, limits)
        return PreparedItem(self.video_item(media, mm_hash, clip), {"pixel_values": clip.pixel_values})

    def image_item(self, media: MediaInput, mm_hash: str, image: ImageLayout) -> ItemLayout:
        """An image's layout from its patch grid (`preprocess`, or `QwenVisionPreprocessor.image_grid`
        where another engine's processor makes the pixels)."""
        count = image.grid_t * image.grid_h * image.grid_w // self.merge_size**2
        return ItemLayout(media.modality, media.item_index, mm_hash, count, image=image)

    def video_item(self, media: MediaInput, mm_hash: str, clip: VideoPixels) -> ItemLayout:
        """A video's layout from its sampled, resized clip."""
        tp = self.vision.temporal_patch_size
        # `Qwen2_5_VLProcessor._process_videos` (and qwen-vl-utils): temporal patch / sampled fps.
        spg = tp / clip.decoded.sampled_fps
        video = video_layout(clip, tp, seconds_per_grid=spg, mean_times=self.mean_patch_times)
        count = video.grid_t * video.grid_h * video.grid_w // self.merge_size**2
        return ItemLayout(media.modality, media.item_index, mm_hash, count, video=video)

    def tower(self, encoder: torch.nn.Module, items: list[PreparedItem]) -> Any:
        """One vision-tower forward over a batch of items (transformers output object)."""
        grids = [item.layout.image or item.layout.video for item in items]
        grid_thw = torch.tensor([[g.grid_t, g.grid_h, g.grid_w] for g in grids if g is not None])
        pixels = torch.cat([item.inputs["pixel_values"] for item in items], dim=0)
        visual: Any = encoder["visual"]  # type: ignore[index]
        return visual(pixels.to(visual.patch_embed.proj.weight.dtype), grid_thw=grid_thw)

    def encode(
        self, encoder: torch.nn.Module, modality: Modality, items: list[PreparedItem]
    ) -> list[dict[str, torch.Tensor]]:
        counts = [item.layout.placeholder_token_count for item in items]
        out = self.tower(encoder, items).pooler_output
        if out.shape[0] != sum(counts):
            raise EmbeddingMismatchError(f"tower produced {out.shape[0]} rows, expected {sum(counts)}")
        return [{"embeddings": part.contiguous()} for part in torch.split(out, counts)]

    def dummy_media(self, modality: Modality) -> MediaInput:
        if modality is Modality.IMAGE:
            return MediaInput(modality, synthetic.png_bytes(56, 56, seed=0))
        return MediaInput(modality, synthetic.video_bytes(56, 56, frames=4, fps=2, seed=0))

    # ---- positions / LM ----
    def temporal_index(self, layout: ItemLayout) -> torch.Tensor:
        """t position (before the item's start offset) of each temporal patch."""
        grid = self.grid(layout)
        return torch.zeros(grid.grid_t, dtype=torch.long)

    def mrope_spans(self, placed: PlacedItem) -> list[tuple[int, torch.Tensor]]:
        grid = self.grid(placed.layout)
        offsets = vision_position_offsets(
            grid.grid_t, grid.grid_h, grid.grid_w, self.merge_size, self.temporal_index(placed.layout)
        )
        return [(placed.start, offsets)]

    def position_ids(self, input_ids: list[int], items: list[PlacedItem]) -> tuple[torch.Tensor, int]:
        spans = [span for placed in items for span in self.mrope_spans(placed)]
        return build_mrope(len(input_ids), spans)

    def lm_kwargs(self, extras: dict[str, torch.Tensor] | None) -> dict[str, Any]:
        """Extra keyword arguments for the text model's forward (deepstack); default none."""
        return {}

    def lm_forward(
        self,
        lm: torch.nn.Module,
        inputs_embeds: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DynamicCache,
        attention_mask: torch.Tensor | None,
        extras: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        model: Any = lm.model
        hidden = model(
            inputs_embeds=inputs_embeds,
            position_ids=position_ids,
            past_key_values=cache,
            attention_mask=attention_mask,
            use_cache=True,
            **self.lm_kwargs(extras),
        ).last_hidden_state
        head: Any = lm.lm_head
        logits: torch.Tensor = head(hidden[:, -1:, :])
        return logits
