"""Whisper on vLLM with its encoder elsewhere: the decoder cross-attends to the encoder states
EPD's encoder computed, and every step's logits go through generate()'s processors.

vLLM 0.32 cannot take a Whisper request's encoder outputs from an EC connector: it skips the
encoder cache for encoder-decoder models and always runs the tower on the request's
`input_features`. So the PD service hands them over in the request: the audio item is the
window's encoder states ([1500, d_model]) as vLLM's `audio_embeds` (`enable_mm_embeds`).

- `EpdWhisperForConditionalGeneration` (registered by `plugin.py`; the engine names it through
  `hf_overrides`): vLLM's Whisper whose `embed_multimodal` returns `audio_embeds` as given
  (input features, which only vLLM's start-up profiling sends, still run the tower);
- `EncoderStatesProcessor`: vLLM's Whisper processor that keeps `audio_embeds` as the item's field;
- `WhisperLogits`: generate()'s begin-suppress, suppress and timestamp rules, the reference
  runtime's own (`WhisperAdapter.process_logits`), on the requests that carry `WHISPER_TIMESTAMPS_ARG`.

Imported by vLLM only: the model and processor where it parses requests (the service's process)
and loads the model (EngineCore), `WhisperLogits` in EngineCore's sampler.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import torch
from vllm.model_executor.models.whisper import (
    WhisperDummyInputsBuilder,
    WhisperForConditionalGeneration,
    WhisperMultiModalProcessor,
    WhisperProcessingInfo,
)
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.inputs import MultiModalFieldConfig
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

from libs.backends.vllm.plugin import WHISPER_TIMESTAMPS_ARG
from libs.model.checkpoint import Checkpoint
from libs.model.families.whisper import WhisperAdapter
from libs.model.types import SamplingParams


class EncoderStatesProcessor(WhisperMultiModalProcessor):
    def _get_mm_fields_config(self, hf_inputs: Any, hf_processor_mm_kwargs: Mapping[str, object]) -> Any:
        if "audio_embeds" in hf_inputs:
            return dict(audio_embeds=MultiModalFieldConfig.batched("audio"))
        return super()._get_mm_fields_config(hf_inputs, hf_processor_mm_kwargs)


@MULTIMODAL_REGISTRY.register_processor(
    EncoderStatesProcessor, info=WhisperProcessingInfo, dummy_inputs=WhisperDummyInputsBuilder
)
class EpdWhisperForConditionalGeneration(WhisperForConditionalGeneration):  # type: ignore[no-untyped-call]
    def embed_multimodal(self, **kwargs: object) -> Any:
        states = kwargs.get("audio_embeds")
        if states is None:
            return super().embed_multimodal(**kwargs)
        # One [rows, d_model] per item: a stacked [items, rows, d_model] tensor or a list of them.
        assert isinstance(states, torch.Tensor | list), type(states)
        return tuple(state.to(self.dtype) for state in states)


class WhisperLogits(AdapterLogitsProcessor):
    """generate()'s Whisper logits processors, per request, in EngineCore's sampler."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        super().__init__(vllm_config, device, is_pin_memory)
        self.adapter = WhisperAdapter(Checkpoint(vllm_config.model_config.model))

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: Any) -> Any:
        extra = params.extra_args or {}
        if WHISPER_TIMESTAMPS_ARG not in extra:
            return None
        return partial(_process, self.adapter, SamplingParams(timestamps=bool(extra[WHISPER_TIMESTAMPS_ARG])))


def _process(
    adapter: WhisperAdapter, sampling: SamplingParams, output_ids: list[int], logits: torch.Tensor
) -> torch.Tensor:
    return adapter.process_logits(logits, output_ids, sampling)
