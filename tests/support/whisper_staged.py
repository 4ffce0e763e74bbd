"""Whisper through the engine's E, P and D runners as three separate stages (each with its own
runner and model copy; what passes between them is what the services move: an `EncodedItem`, then
a `KvCache` with self- and cross-attention tensors and a `DecodeState`), driven by generate()'s
long-form window loop (`libs.speech.longform`); and the reference: the model's own generate() fed
by its own processor."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from libs.model.types import (
    ChatMessage,
    ChatRole,
    EncodedItem,
    EncodedPart,
    KvCache,
    MediaInput,
    Modality,
    PrefillResult,
    SamplingParams,
)
from libs.runtime.decode_runner import DecodeRunner
from libs.runtime.encoder_runner import EncoderRunner
from libs.runtime.lm_runtime import LanguageModelRuntime
from libs.runtime.prefill_runner import PrefillRunner
from libs.speech.longform import Segment, WindowSegmenter
from tests.support.hf_reference import reference_audio

WINDOW_FRAMES = 3000  # mel frames in one 30 s window


@dataclass
class Transcript:
    tokens: list[int] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    windows: list[dict[str, int]] = field(default_factory=list)
    first_logits: list[torch.Tensor] = field(default_factory=list)  # prefill's raw logits per window


def load_reference(path: Path) -> tuple[Any, Any]:
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    model = WhisperForConditionalGeneration.from_pretrained(str(path)).eval()
    return model, WhisperProcessor.from_pretrained(str(path))


def reference_tokens(model: Any, processor: Any, data: bytes) -> list[int]:
    """generate() as its documentation says to call it, greedy: short-form for <= 30 s; else
    sequential long-form with the whole clip's features (truncation=False, padding="longest"), the
    attention mask and return_timestamps=True (long-form needs timestamps; no temperature fallback,
    condition_on_prev_tokens False: the defaults)."""
    audio = reference_audio(data, "wav", processor.feature_extractor.sampling_rate)
    with torch.inference_mode():
        if audio.size <= processor.feature_extractor.n_samples:
            inputs = processor(audio, sampling_rate=16000, return_tensors="pt")
            out = model.generate(inputs.input_features)
        else:
            inputs = processor(
                audio,
                sampling_rate=16000,
                return_tensors="pt",
                truncation=False,
                padding="longest",
                return_attention_mask=True,
            )
            out = model.generate(inputs.input_features, attention_mask=inputs.attention_mask, return_timestamps=True)
    return [int(t) for t in out[0].tolist()]


def transcribe_and_check(address: str, model_path: Path, names: Sequence[str], tag: str) -> dict[str, Any]:
    """The corpus clips `names` transcribed together through the router at `address`; each must be
    generate()'s tokens, text and usage (greedy, fed by WhisperProcessor). Returns the results."""
    from libs.client.transcribe import audio_item, transcription_request
    from tests.support.speech_corpus import UTTERANCES, utterance
    from tests.support.stacks import run_requests

    clips = {name: utterance(*UTTERANCES[name]) for name in names}
    requests = [transcription_request(audio_item(clips[n], item_id=n), request_id=f"{tag}{n}") for n in names]
    results = dict(zip(names, run_requests(address, requests, timeout_s=480.0), strict=True))
    model, processor = load_reference(model_path)
    for name in names:
        expected = reference_tokens(model, processor, clips[name])
        got = results[name]
        assert got.token_ids == expected, name
        assert got.finish_reason == "FINISH_REASON_STOP"
        assert got.completion_tokens == len(expected)
        assert got.text.strip() == processor.tokenizer.decode(expected, skip_special_tokens=True).strip(), name
    return results


class WhisperStages:
    """E, P and D runners for one Whisper checkpoint, each loading only its part of the weights."""

    def __init__(self, model: Path) -> None:
        self.encoder = EncoderRunner(model)
        self.prefill = PrefillRunner(LanguageModelRuntime(model))
        self.decode = DecodeRunner(LanguageModelRuntime(model))
        self.eos = self.decode.runtime.eos_token_ids

    def _encode(self, data: bytes, seek: int) -> EncodedItem:
        return self.encoder.encode([MediaInput(Modality.AUDIO, data, audio_window_start_frame=seek)])[0]

    def _prefill(self, item: EncodedItem, timestamps: bool) -> PrefillResult:
        messages = [ChatMessage(ChatRole.USER, (EncodedPart(item),))]
        return self.prefill.prefill(messages, SamplingParams(timestamps=timestamps), return_logits=True)

    def _decode(self, requests: list[tuple[str, KvCache, PrefillResult, bool]]) -> dict[str, list[int]]:
        """Every request to its end, at most the decode runner's batch at a time."""
        out: dict[str, list[int]] = {}
        pending = list(requests)
        while pending or self.decode.active_ids:
            while pending and len(self.decode.active_ids) < self.decode.max_batch:
                name, kv, result, timestamps = pending.pop(0)
                self.decode.add(name, kv, result.decode_state, SamplingParams(timestamps=timestamps))
                out[name] = []
            for name, (chunk, _) in self.decode.step().items():
                out[name] += chunk.token_ids
        return out

    def transcribe(self, clips: dict[str, bytes], timestamp_begin: int) -> dict[str, Transcript]:
        """Every clip's windows, in rounds: each round encodes and prefills one window per clip still
        going, then decodes all of them batched."""
        out = {name: Transcript() for name in clips}
        seek = dict.fromkeys(clips, 0)
        going = list(clips)
        while going:
            batch, segmenters, first = [], {}, {}
            for name in going:
                item = self._encode(clips[name], seek[name])
                audio = item.layout.audio
                assert audio is not None
                timestamps = audio.clip_frames > WINDOW_FRAMES  # long-form needs timestamps, as generate()
                result = self._prefill(item, timestamps)
                assert result.logits is not None
                out[name].first_logits.append(result.logits)
                out[name].windows.append({"seek": seek[name], "frames": audio.window_frames})
                segmenters[name] = (WindowSegmenter(timestamp_begin, seek[name], audio.window_frames), audio)
                first[name] = list(result.first_chunk.token_ids)
                if result.kv_cache is not None:
                    batch.append((name, result.kv_cache, result, timestamps))
            decoded = self._decode(batch) if batch else {}
            for name in list(going):
                segmenter, audio = segmenters[name]
                tokens = first[name] + decoded.get(name, [])
                if tokens and tokens[-1] in self.eos:
                    tokens = tokens[:-1]
                for token in tokens:
                    out[name].tokens += segmenter.push(token)
                rest, advance = segmenter.finish()
                assert advance > 0, (name, seek[name], tokens)
                out[name].tokens += rest
                out[name].segments += segmenter.segments()
                seek[name] += advance
                if seek[name] >= audio.clip_frames:
                    going.remove(name)
        return out
