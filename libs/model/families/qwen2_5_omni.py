"""Qwen2.5-Omni thinker: vision tower (image + video), audio tower, Qwen2 language model, M-RoPE."""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache, WhisperFeatureExtractor
from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniThinkerConfig
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
    Qwen2_5OmniAudioEncoder,
    Qwen2_5OmniThinkerTextModel,
    Qwen2_5OmniVisionEncoder,
)
from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import Qwen2_5OmniProcessor

from libs.model.checkpoint import Checkpoint
from libs.model.errors import EmbeddingMismatchError
from libs.model.families.base import FamilyAdapter, PlacedItem, PreparedItem
from libs.model.families.causal_lm import CausalLM, strip_prefixes
from libs.model.families.qwen_settings import processor_video_defaults
from libs.model.families.qwen_vision import QwenVisionPreprocessor, build_mrope, video_layout, vision_position_offsets
from libs.model.media import synthetic
from libs.model.media.audio import decode_audio
from libs.model.media.limits import MediaLimits
from libs.model.types import AudioLayout, ItemLayout, MediaInput, Modality

# Hub checkpoints prefix the thinker with "thinker."; transformers-5 saves may add "model." levels.
_VISUAL = ("thinker.visual.", "thinker.model.visual.", "visual.", "model.visual.")
_AUDIO = ("thinker.audio_tower.", "thinker.model.audio_tower.", "audio_tower.", "model.audio_tower.")
_LM = ("thinker.model.language_model.", "thinker.model.", "model.language_model.", "model.")
_HEAD = ("thinker.lm_head.", "lm_head.")


def _from_config(cls: Any, config: Any) -> torch.nn.Module:
    module: torch.nn.Module = cls._from_config(config)
    return module


def audio_output_length(feature_length: int) -> int:
    after_cnn = (feature_length - 1) // 2 + 1
    return (after_cnn - 2) // 2 + 1


class Qwen25OmniAdapter(FamilyAdapter):
    family = "qwen2_5_omni"
    modalities = frozenset({Modality.IMAGE, Modality.VIDEO, Modality.AUDIO})

    def __init__(self, checkpoint: Checkpoint) -> None:
        super().__init__(checkpoint)
        raw = checkpoint.config
        thinker = raw.get("thinker_config", raw) if raw.get("model_type") == "qwen2_5_omni" else raw
        self.config: Any = Qwen2_5OmniThinkerConfig.from_dict(thinker)
        vision: Any = self.config.vision_config
        self.merge_size = int(vision.spatial_merge_size)
        # The Omni processor's own video size default wins over the video processor's file.
        omni_video_size = processor_video_defaults(Qwen2_5OmniProcessor).get("size")
        self.vision = QwenVisionPreprocessor(
            checkpoint, vision, video_style="qwen2_vl", video_size_override=omni_video_size
        )
        # The reference's feature extractor, configured from the same file by the same loader.
        self.features: Any = WhisperFeatureExtractor.from_pretrained(str(checkpoint.path))

    # ---- weights ----
    def encoder_tensor_name(self, name: str) -> str | None:
        if (rest := strip_prefixes(name, _VISUAL)) is not None:
            return "visual." + rest
        if (rest := strip_prefixes(name, _AUDIO)) is not None:
            return "audio_tower." + rest
        return None

    def lm_tensor_name(self, name: str) -> str | None:
        if name.startswith(("talker.", "token2wav.")) or self.encoder_tensor_name(name) is not None:
            return None
        if (rest := strip_prefixes(name, _HEAD)) is not None:
            return "lm_head." + rest
        if (rest := strip_prefixes(name, _LM)) is not None:
            return "model." + rest
        return None

    def build_encoder(self) -> torch.nn.Module:
        return torch.nn.ModuleDict(
            {
                "visual": _from_config(Qwen2_5OmniVisionEncoder, self.config.vision_config),
                "audio_tower": _from_config(Qwen2_5OmniAudioEncoder, self.config.audio_config),
            }
        )

    def build_language_model(self) -> torch.nn.Module:
        text = self.config.text_config
        return CausalLM(_from_config(Qwen2_5OmniThinkerTextModel, text), text.hidden_size, text.vocab_size)

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
        return {Modality.IMAGE: "<|IMAGE|>", Modality.VIDEO: "<|VIDEO|>", Modality.AUDIO: "<|AUDIO|>"}[modality]

    def content_type(self, modality: Modality) -> str:
        return modality.value

    # ---- media ----
    def preprocess(self, media: MediaInput, mm_hash: str, limits: MediaLimits) -> PreparedItem:
        merge = self.merge_size**2
        if media.modality is Modality.IMAGE:
            pixels, image = self.vision.image(media.data, media.options, limits)
            count = image.grid_t * image.grid_h * image.grid_w // merge
            layout = ItemLayout(media.modality, media.item_index, mm_hash, count, image=image)
            return PreparedItem(layout, {"pixel_values": pixels})
        if media.modality is Modality.VIDEO:
            clip = self.vision.video(media.data, media.options, limits)
            tp = self.vision.temporal_patch_size
            # The Omni processor: temporal patch / requested fps, whatever was sampled.
            video = video_layout(clip, tp, seconds_per_grid=tp / clip.fps, mean_times=False)
            count = video.grid_t * video.grid_h * video.grid_w // merge
            layout = ItemLayout(media.modality, media.item_index, mm_hash, count, video=video)
            return PreparedItem(layout, {"pixel_values": clip.pixel_values})
        samples = decode_audio(media.data, self.features.sampling_rate, limits)
        out: Any = self.features(
            samples,
            sampling_rate=self.features.sampling_rate,
            padding="max_length",
            return_attention_mask=True,
            return_tensors="pt",
        )
        length = int(out["attention_mask"][0].sum())
        features = out["input_features"][0, :, :length]
        audio = AudioLayout(
            feature_length=length,
            output_length=audio_output_length(length),
            duration_s=samples.size / self.features.sampling_rate,
        )
        layout = ItemLayout(media.modality, media.item_index, mm_hash, audio.output_length, audio=audio)
        return PreparedItem(layout, {"input_features": features})

    def encode(
        self, encoder: torch.nn.Module, modality: Modality, items: list[PreparedItem]
    ) -> list[dict[str, torch.Tensor]]:
        counts = [item.layout.placeholder_token_count for item in items]
        if modality is Modality.AUDIO:
            lengths = torch.tensor([item.layout.audio.feature_length for item in items if item.layout.audio])
            features = torch.cat([item.inputs["input_features"] for item in items], dim=1)
            tower: Any = encoder["audio_tower"]  # type: ignore[index]
            out = tower(
                features.to(tower.conv1.weight.dtype), feature_lens=lengths, aftercnn_lens=(lengths - 1) // 2 + 1
            ).last_hidden_state
        else:
            grids = [item.layout.image or item.layout.video for item in items]
            grid_thw = torch.tensor([[g.grid_t, g.grid_h, g.grid_w] for g in grids if g is not None])
            pixels = torch.cat([item.inputs["pixel_values"] for item in items], dim=0)
            visual: Any = encoder["visual"]  # type: ignore[index]
            out = visual(pixels.to(visual.patch_embed.proj.weight.dtype), grid_thw=grid_thw).pooler_output
        if out.shape[0] != sum(counts):
            raise EmbeddingMismatchError(f"tower produced {out.shape[0]} rows, expected {sum(counts)}")
        return [{"embeddings": part.contiguous()} for part in torch.split(out, counts)]

    def dummy_media(self, modality: Modality) -> MediaInput:
        if modality is Modality.IMAGE:
            return MediaInput(modality, synthetic.png_bytes(56, 56, seed=0))
        if modality is Modality.VIDEO:
            return MediaInput(modality, synthetic.video_bytes(56, 56, frames=4, fps=2, seed=0))
        return MediaInput(modality, synthetic.wav_bytes(1.0, seed=0))

    # ---- positions / LM ----
    def position_ids(self, input_ids: list[int], items: list[PlacedItem]) -> tuple[torch.Tensor, int]:
        per_second = self.config.position_id_per_seconds
        spans: list[tuple[int, torch.Tensor]] = []
        for placed in items:
            layout = placed.layout
            if layout.audio is not None:
                n = layout.placeholder_token_count
                spans.append((placed.start, torch.arange(n).view(1, -1).expand(3, -1)))
                continue
            grid = layout.image or layout.video
            assert grid is not None
            if layout.video is not None:
                # Same float32 arithmetic as transformers, so truncation lands on the same integers.
                spg = torch.tensor(layout.video.seconds_per_grid, dtype=torch.float32)
                t_index = (torch.arange(grid.grid_t) * spg * per_second).long()
            else:
                t_index = (torch.arange(grid.grid_t) * 1 * per_second).long()
            offsets = vision_position_offsets(grid.grid_t, grid.grid_h, grid.grid_w, self.merge_size, t_index)
            spans.append((placed.start, offsets))
        return build_mrope(len(input_ids), spans)

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
        ).last_hidden_state
        head: Any = lm.lm_head
        logits: torch.Tensor = head(hidden[:, -1:, :])
        return logits
