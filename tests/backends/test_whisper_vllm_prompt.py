"""Why vLLM's transcripts of the converted tiny.en checkpoint are empty (issue 25): vLLM 0.32's
Whisper prompt is always `<|startoftranscript|><|LANG|><|TASK|><|notimestamps|>`
(`WhisperForConditionalGeneration.get_generation_prompt`), while an English-only checkpoint was
trained on `<|startoftranscript|><|notimestamps|>` alone (what generate() sends it). Greedy from
vLLM's prompt, the model ends at once; from the English-only prompt it says what generate() says.
The model is the checkpoint itself (transformers), stepped greedily by hand from each prompt."""

from __future__ import annotations

import pytest
import torch

from libs.model.checkpoints.generate import ensure_converted
from tests.support.speech_corpus import UTTERANCES, utterance
from tests.support.whisper_staged import load_reference, reference_tokens

pytestmark = pytest.mark.integration


def _greedy(model: object, features: torch.Tensor, prompt: list[int], eos: int, steps: int = 40) -> list[int]:
    seq = list(prompt)
    with torch.inference_mode():
        for _ in range(steps):
            logits = model(input_features=features, decoder_input_ids=torch.tensor([seq])).logits[0, -1]  # type: ignore[operator]
            seq.append(int(logits.argmax()))
            if seq[-1] == eos:
                break
    return seq[len(prompt) :]


def test_vllms_prompt_ends_an_english_only_whisper_at_once() -> None:
    from tests.support.hf_reference import reference_audio

    model, processor = load_reference(ensure_converted())
    tokenizer = processor.tokenizer
    clip = utterance(*UTTERANCES["short"])
    features = processor(reference_audio(clip, "wav", 16000), sampling_rate=16000, return_tensors="pt").input_features
    ids = tokenizer.convert_tokens_to_ids
    english_only = [ids("<|startoftranscript|>"), ids("<|notimestamps|>")]
    vllms = [ids("<|startoftranscript|>"), ids("<|en|>"), ids("<|transcribe|>"), ids("<|notimestamps|>")]
    expected = reference_tokens(model, processor, clip)
    assert _greedy(model, features, english_only, tokenizer.eos_token_id)[: len(expected)] == expected
    assert _greedy(model, features, vllms, tokenizer.eos_token_id) == [tokenizer.eos_token_id]
