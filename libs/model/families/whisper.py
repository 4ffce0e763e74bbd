"""Whisper (encoder-decoder speech recognition), staged as the model's own `generate()` runs it.

- E: audio -> log-mel features (the checkpoint's `WhisperFeatureExtractor`, called as the processor
  is called for the clip's length) -> one 30 s window through the encoder -> encoder states
  [1500, d_model]. A clip of at most 30 s is one window, its waveform padded to 30 s (short-form);
  a longer one has its features computed over the whole clip (the log-mel floor is the clip's
  maximum - 8), and the window starting at `MediaInput.audio_window_start_frame` is cut out
  and zero-padded to 3000 frames, as `generate()`'s long-form loop does (`_get_input_segment`).
- P: the decoder prompt `generate()` starts from (`_retrieve_init_tokens`: start of transcript,
  the forced language/task tokens, `<|notimestamps|>` unless timestamps are asked for), one decoder
  forward that also builds every layer's cross-attention KV from the encoder states, first token.
- D: decoder steps over the self- and cross-attention KV.
Every step's logits go through generate()'s processors in its order: begin-suppress (first token
only), suppress, and with timestamps the timestamp rules (`process_logits`).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import torch
from transformers import DynamicCache, EncoderDecoderCache, WhisperConfig, WhisperFeatureExtractor
from transformers.models.whisper.modeling_whisper import WhisperDecoder, WhisperEncoder

from libs.model.checkpoint import Checkpoint
from libs.model.errors import CheckpointError, EmbeddingMismatchError, InvalidRequestError
from libs.model.families.base import FamilyAdapter, PlacedItem, PreparedItem
from libs.model.families.causal_lm import strip_prefixes
from libs.model.media import synthetic
from libs.model.media.audio import decode_audio
from libs.model.media.limits import MediaLimits
from libs.model.types import AudioLayout, ItemLayout, MediaInput, Modality, SamplingParams

_ENCODER = ("model.encoder.", "encoder.")
_DECODER = ("model.decoder.", "decoder.")
_HEAD = ("proj_out.",)
WINDOW_FIELD = "media.audio_window_start_frame"


def _from_config(cls: Any, config: Any) -> torch.nn.Module:
    module: torch.nn.Module = cls._from_config(config)
    return module


class WhisperDecoderLM(torch.nn.Module):
    """The decoder half: token + position embeddings, decoder layers, output projection."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.decoder: Any = _from_config(WhisperDecoder, config)
        self.proj_out = torch.nn.Linear(config.d_model, config.vocab_size, bias=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.decoder.embed_tokens(input_ids)
        return out


@dataclasses.dataclass(frozen=True)
class TimestampRules:
    """The token ids `generate()`'s Whisper logits processors use."""

    no_timestamps: int
    timestamp_begin: int
    eos: int
    max_initial_timestamp_index: int | None


class WhisperAdapter(FamilyAdapter):
    family = "whisper"
    modalities = frozenset({Modality.AUDIO})
    is_encoder_decoder = True

    def __init__(self, checkpoint: Checkpoint) -> None:
        super().__init__(checkpoint)
        self.config: Any = WhisperConfig.from_dict(checkpoint.config)
        self.features: Any = WhisperFeatureExtractor.from_pretrained(str(checkpoint.path))
        if self.features.feature_size != self.config.num_mel_bins:
            raise CheckpointError(
                f"feature extractor makes {self.features.feature_size} mel bins, the encoder takes "
                f"{self.config.num_mel_bins}",
                field="model_path",
            )
        # generate() reads generation_config.json and falls back to the model config.
        gen = checkpoint.json_file("generation_config.json")
        cfg = checkpoint.config
        self.suppress = torch.tensor(gen.get("suppress_tokens", cfg.get("suppress_tokens")) or [], dtype=torch.long)
        begin = gen.get("begin_suppress_tokens", cfg.get("begin_suppress_tokens")) or []
        self.begin_suppress = torch.tensor(begin, dtype=torch.long)
        self.prompt_tokens = self._init_tokens(gen, cfg)
        no_ts, eos = gen.get("no_timestamps_token_id"), gen.get("eos_token_id", cfg.get("eos_token_id"))
        self.rules = (
            TimestampRules(
                no_timestamps=int(no_ts),
                timestamp_begin=int(no_ts) + 1,
                eos=int(eos),
                max_initial_timestamp_index=gen.get("max_initial_timestamp_index"),
            )
            if no_ts is not None and eos is not None
            else None
        )
        stride = 2  # conv1 stride 1 x conv2 stride 2 (generate()'s `input_stride`)
        self.window_frames = int(self.config.max_source_positions) * stride
        self.input_stride = stride

    @staticmethod
    def _init_tokens(gen: dict[str, Any], cfg: dict[str, Any]) -> list[int]:
        """generate()'s `_retrieve_init_tokens` with no language or task given, before the
        timestamp choice: the start token, then the forced tokens at positions 1, 2, ..."""
        start = gen.get("decoder_start_token_id", cfg.get("decoder_start_token_id"))
        if start is None:
            raise CheckpointError("no decoder_start_token_id", field="model_path")
        tokens = [int(start)]
        forced = gen.get("forced_decoder_ids") or cfg.get("forced_decoder_ids") or []
        for position, (index, token) in enumerate(forced, start=1):
            if index != position:
                break
            tokens.append(token)
        language_given = len(tokens) > 1 and tokens[1] is not None
        if gen.get("lang_to_id") and not language_given:
            # generate() would detect the language first (a separate decoder pass per window).
            raise CheckpointError(
                "multilingual Whisper without a forced language needs language detection, not supported",
                field="model_path",
            )
        return [t for t in tokens if t is not None]

    # ---- weights ----
    def encoder_tensor_name(self, name: str) -> str | None:
        rest = strip_prefixes(name, _ENCODER)
        return None if rest is None else "encoder." + rest

    def lm_tensor_name(self, name: str) -> str | None:
        if (rest := strip_prefixes(name, _DECODER)) is not None:
            return "decoder." + rest
        if (rest := strip_prefixes(name, _HEAD)) is not None:
            return "proj_out." + rest
        return None

    def build_encoder(self) -> torch.nn.Module:
        return torch.nn.ModuleDict({"encoder": _from_config(WhisperEncoder, self.config)})

    def build_language_model(self) -> torch.nn.Module:
        return WhisperDecoderLM(self.config)

    def finish_language_model(self, module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        if "proj_out.weight" not in tensors and "decoder.embed_tokens.weight" in tensors:
            tensors["proj_out.weight"] = tensors["decoder.embed_tokens.weight"]  # tied, as on the hub

    @property
    def hidden_size(self) -> int:
        return int(self.config.d_model)

    @property
    def text_config(self) -> Any:
        heads = int(self.config.decoder_attention_heads)
        return SimpleNamespace(
            num_hidden_layers=int(self.config.decoder_layers),
            num_key_value_heads=heads,
            num_attention_heads=heads,
            hidden_size=int(self.config.d_model),
            head_dim=int(self.config.d_model) // heads,
        )

    @property
    def cross_attention_tokens(self) -> int:
        return int(self.config.max_source_positions)

    @property
    def max_positions(self) -> int:
        return int(self.config.max_target_positions)

    def placeholder_token(self, modality: Modality) -> str:
        raise InvalidRequestError("Whisper has no prompt placeholders", field="messages")

    def content_type(self, modality: Modality) -> str:
        return modality.value

    # ---- media ----
    def preprocess(self, media: MediaInput, mm_hash: str, limits: MediaLimits) -> PreparedItem:
        rate = int(self.features.sampling_rate)
        samples = decode_audio(
            media.data, rate, dataclasses.replace(limits, max_audio_seconds=limits.max_speech_seconds)
        )
        start = media.audio_window_start_frame
        if samples.size <= self.features.n_samples:
            # Short-form: the processor pads the waveform to 30 s (one window, generate() counts 3000 frames).
            if start:
                raise InvalidRequestError(
                    f"a {samples.size / rate:.2f} s clip has one window, at frame 0", field=WINDOW_FIELD
                )
            out: Any = self.features(samples, sampling_rate=rate, return_tensors="pt")
            features = out["input_features"][0]
            clip_frames = window_frames = self.window_frames
        else:
            # Long-form: features over the whole clip, as the processor makes them with
            # truncation=False, padding="longest"; then generate()'s window cut and zero padding.
            out = self.features(
                samples,
                sampling_rate=rate,
                truncation=False,
                padding="longest",
                return_attention_mask=True,
                return_tensors="pt",
            )
            clip_frames = int(out["input_features"].shape[-1])
            if not 0 <= start < clip_frames:
                raise InvalidRequestError(
                    f"window start {start} is outside the clip's {clip_frames} frames", field=WINDOW_FIELD
                )
            window = out["input_features"][0, :, start : start + self.window_frames]
            window_frames = int(window.shape[-1])
            features = torch.nn.functional.pad(window, (0, self.window_frames - window_frames))
        rows = self.cross_attention_tokens
        audio = AudioLayout(
            feature_length=self.window_frames,
            output_length=rows,
            duration_s=samples.size / rate,
            window_start_frame=start,
            window_frames=window_frames,
            clip_frames=clip_frames,
        )
        layout = ItemLayout(media.modality, media.item_index, mm_hash, 0, audio=audio, cross_attention_rows=rows)
        return PreparedItem(layout, {"input_features": features.contiguous()})

    def encode(
        self, encoder: torch.nn.Module, modality: Modality, items: list[PreparedItem]
    ) -> list[dict[str, torch.Tensor]]:
        tower: Any = encoder["encoder"]  # type: ignore[index]
        features = torch.stack([item.inputs["input_features"] for item in items])
        states = tower(features.to(tower.conv1.weight.dtype)).last_hidden_state
        if states.shape[1] != self.cross_attention_tokens:
            raise EmbeddingMismatchError(
                f"encoder produced {states.shape[1]} rows, expected {self.cross_attention_tokens}"
            )
        return [{"embeddings": row.contiguous()} for row in states]

    def dummy_media(self, modality: Modality) -> MediaInput:
        return MediaInput(modality, synthetic.wav_bytes(1.0, seed=0))

    # ---- decoder ----
    def decoder_prompt(self, sampling: SamplingParams) -> list[int]:
        """generate()'s init tokens: `<|notimestamps|>` last unless timestamps are predicted."""
        tokens = list(self.prompt_tokens)
        if sampling.timestamps and self.rules is None:
            raise InvalidRequestError("this checkpoint has no timestamp tokens", field="sampling.timestamps")
        if self.rules is not None:
            no_ts = self.rules.no_timestamps
            if not sampling.timestamps and tokens[-1] != no_ts:
                tokens.append(no_ts)
            elif sampling.timestamps and tokens[-1] == no_ts:
                tokens.pop()
        return tokens

    def new_cache(self) -> EncoderDecoderCache:
        return EncoderDecoderCache(DynamicCache(), DynamicCache())

    def process_logits(self, logits: torch.Tensor, sampled: list[int], sampling: SamplingParams) -> torch.Tensor:
        """generate()'s processors for one sequence's [vocab] logits, in its order: begin-suppress
        (only for the first generated token), suppress, timestamp rules."""
        scores = logits.clone()
        if not sampled and self.begin_suppress.numel():
            scores[self.begin_suppress] = -float("inf")
        if self.suppress.numel():
            scores[self.suppress] = -float("inf")
        if sampling.timestamps and self.rules is not None:
            scores = _timestamp_rules(scores, sampled, self.rules)
        return scores

    def position_ids(self, input_ids: list[int], items: list[PlacedItem]) -> tuple[torch.Tensor, int]:
        return torch.arange(len(input_ids)).view(1, -1).expand(3, -1), 0

    def lm_forward(
        self,
        lm: torch.nn.Module,
        inputs_embeds: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Any,
        attention_mask: torch.Tensor | None,
        extras: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        model: Any = lm
        # Prefill passes the encoder states (the cross-attention KV is built from them); decode's
        # cache already holds that KV and only needs a non-None placeholder to run cross-attention.
        states = extras["encoder_states"] if extras else inputs_embeds.new_zeros(inputs_embeds.shape[0], 0, 1)
        hidden = model.decoder(
            inputs_embeds=inputs_embeds,
            position_ids=position_ids[0],
            encoder_hidden_states=states,
            past_key_values=cache,
            attention_mask=attention_mask,
            use_cache=True,
        ).last_hidden_state
        logits: torch.Tensor = model.proj_out(hidden[:, -1:, :])
        return logits


def _timestamp_rules(scores: torch.Tensor, sampled: list[int], rules: TimestampRules) -> torch.Tensor:
    """transformers' `WhisperTimeStampLogitsProcessor` for one sequence (`sampled`: the tokens
    generated so far, after the prompt)."""
    begin = rules.timestamp_begin
    scores[rules.no_timestamps] = -float("inf")
    last_was_timestamp = len(sampled) >= 1 and sampled[-1] >= begin
    penultimate_was_timestamp = len(sampled) < 2 or sampled[-2] >= begin
    if last_was_timestamp:
        if penultimate_was_timestamp:  # a pair just closed: text (or end) comes next
            scores[begin:] = -float("inf")
        else:  # an opening timestamp needs its closing one
            scores[: rules.eos] = -float("inf")
    timestamps = [t for t in sampled if t >= begin]
    if timestamps:
        # Timestamps never decrease; after text, not even repeat.
        last = timestamps[-1] if last_was_timestamp and not penultimate_was_timestamp else timestamps[-1] + 1
        scores[begin:last] = -float("inf")
    if not sampled:  # the first token is a timestamp, at most max_initial_timestamp_index in
        scores[:begin] = -float("inf")
        if rules.max_initial_timestamp_index is not None:
            scores[begin + rules.max_initial_timestamp_index + 1 :] = -float("inf")
    logprobs = torch.nn.functional.log_softmax(scores.float(), dim=-1)
    if logprobs[begin:].logsumexp(dim=-1) > logprobs[:begin].max():
        scores[:begin] = -float("inf")
    return scores
