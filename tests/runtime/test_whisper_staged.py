"""Whisper tiny.en (trained weights) through the engine's E, P and D runners equals the model's own
generate() token for token: five utterances of different lengths decoded in one batch, one of them
over 30 s through generate()'s long-form window loop (timestamps, two windows). The transcripts are
real words: their word error rate against the known text is bounded. (The WER over 24 sentences,
E/P/D against generate(): `python -m tests.runtime.whisper_report`.)"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from libs.model.checkpoints.generate import ensure_converted
from tests.support.speech_corpus import UTTERANCES, utterance
from tests.support.speech_wer import corpus_wer
from tests.support.whisper_staged import Transcript, WhisperStages, load_reference, reference_tokens

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread for this module (the machine's cores are shared; threads waiting on each
    other cost more than they give for a 39 M model). Restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def whisper_path() -> Path:
    return ensure_converted()


@pytest.fixture(scope="module")
def clips() -> dict[str, bytes]:
    return {name: utterance(text, wpm) for name, (text, wpm) in UTTERANCES.items()}


@pytest.fixture(scope="module")
def reference(whisper_path: Path) -> Any:
    return load_reference(whisper_path)


@pytest.fixture(scope="module")
def split(whisper_path: Path, clips: dict[str, bytes], reference: Any) -> dict[str, Any]:
    stages = WhisperStages(whisper_path)
    begin = reference[1].tokenizer.convert_tokens_to_ids("<|notimestamps|>") + 1
    return {"stages": stages, "transcripts": stages.transcribe(clips, begin)}


@pytest.fixture(scope="module")
def expected(clips: dict[str, bytes], reference: Any) -> Callable[[str], list[int]]:
    """generate()'s tokens for one utterance, computed by the test that needs them (each within
    its own timeout)."""
    model, processor = reference
    return functools.cache(lambda name: reference_tokens(model, processor, clips[name]))


def test_each_stage_loaded_only_its_part(split: dict[str, Any]) -> None:
    stages: WhisperStages = split["stages"]
    assert all(name.startswith("model.encoder.") for name in stages.encoder.checkpoint.loaded_names)
    for runtime in (stages.prefill.runtime, stages.decode.runtime):
        assert all(name.startswith("model.decoder.") for name in runtime.checkpoint.loaded_names)


@pytest.mark.parametrize("name", list(UTTERANCES))
def test_split_tokens_equal_generate(name: str, split: dict[str, Any], expected: Callable[[str], list[int]]) -> None:
    transcript: Transcript = split["transcripts"][name]
    assert transcript.tokens == expected(name)


def test_transcripts_are_real_words(split: dict[str, Any], reference: Any) -> None:
    """espeak-ng speech is hard for tiny.en (~20-30% WER); random weights would be ~100%."""
    tokenizer = reference[1].tokenizer
    pairs = [
        (UTTERANCES[name][0], tokenizer.decode(t.tokens, skip_special_tokens=True))
        for name, t in split["transcripts"].items()
    ]
    assert corpus_wer(pairs) <= 0.4, pairs


def test_long_form_used_windows_and_timestamps(split: dict[str, Any], reference: Any) -> None:
    transcript: Transcript = split["transcripts"]["long_form"]
    assert len(transcript.windows) >= 2
    assert transcript.windows[0] == {"seek": 0, "frames": 3000}
    # The second window starts at the last complete segment, inside the first window's 30 s.
    assert 0 < transcript.windows[1]["seek"] < 3000
    begin = reference[1].tokenizer.convert_tokens_to_ids("<|notimestamps|>") + 1
    assert sum(t >= begin for t in transcript.tokens) >= 4
    starts = [s.start_s for s in transcript.segments]
    assert starts == sorted(starts) and transcript.segments[-1].end_s > 30.0


def test_short_utterances_have_no_timestamps(split: dict[str, Any], reference: Any) -> None:
    begin = reference[1].tokenizer.convert_tokens_to_ids("<|notimestamps|>") + 1
    for name, transcript in split["transcripts"].items():
        if name != "long_form":
            assert len(transcript.windows) == 1
            assert not any(t >= begin for t in transcript.tokens), name


def test_prefill_logits_equal_the_models(split: dict[str, Any], clips: dict[str, bytes], reference: Any) -> None:
    """The first window's prefill logits (before any processor) against the full model's forward
    over the same decoder prompt and the processor's features."""
    from tests.support.hf_reference import reference_audio

    model, processor = reference
    audio = reference_audio(clips["medium"], "wav", 16000)
    features = processor(audio, sampling_rate=16000, return_tensors="pt").input_features
    with torch.inference_mode():
        logits = model(input_features=features, decoder_input_ids=torch.tensor([[50257, 50362]])).logits[0, -1]
    ours = split["transcripts"]["medium"].first_logits[0]
    assert float((ours - logits).abs().max() / logits.abs().max()) < 1e-5


def test_decode_needs_the_cross_attention_kv(split: dict[str, Any], clips: dict[str, bytes]) -> None:
    """A Whisper KV without its cross-attention tensors is refused; another clip's cross-attention
    KV under this clip's prompt KV changes the logits (decode really reads it)."""
    from libs.model.errors import KvMismatchError
    from libs.model.types import ChatMessage, ChatRole, EncodedPart, KvCache, SamplingParams
    from libs.runtime.kv import cross_kv_names

    stages: WhisperStages = split["stages"]

    def prefill(name: str) -> Any:
        item = stages.encoder.encode([stages_media(clips[name])])[0]
        return stages.prefill.prefill([ChatMessage(ChatRole.USER, (EncodedPart(item),))], SamplingParams())

    short, medium = prefill("short"), prefill("medium")
    cross = {n for i in range(short.kv_cache.layout.num_layers) for n in cross_kv_names(i)}
    stripped = {k: v for k, v in short.kv_cache.tensors.items() if k not in cross}
    kv = KvCache(short.kv_cache.layout, stripped, short.kv_cache.weights_digest)
    with pytest.raises(KvMismatchError):
        stages.decode.add("stripped", kv, short.decode_state, SamplingParams())

    def first_step(kv: KvCache) -> torch.Tensor:
        stages.decode.add("probe", kv, short.decode_state, SamplingParams(max_tokens=2))
        (_, row), *_ = stages.decode.step(return_logits=True).values()
        while stages.decode.active_ids:
            stages.decode.step()
        assert row is not None
        return row

    swapped = {**short.kv_cache.tensors, **{k: medium.kv_cache.tensors[k] for k in cross}}
    own = first_step(short.kv_cache)
    other = first_step(KvCache(short.kv_cache.layout, swapped, short.kv_cache.weights_digest))
    assert float((own - other).abs().max() / own.abs().max()) > 1e-3


def test_prefill_refuses_a_text_prompt(split: dict[str, Any], clips: dict[str, bytes]) -> None:
    from libs.model.errors import InvalidRequestError
    from libs.model.types import ChatMessage, ChatRole, EncodedPart, SamplingParams, TextPart

    stages: WhisperStages = split["stages"]
    item = stages.encoder.encode([stages_media(clips["short"])])[0]
    with pytest.raises(InvalidRequestError):
        stages.prefill.prefill([ChatMessage(ChatRole.USER, (TextPart("hello"), EncodedPart(item)))], SamplingParams())


def stages_media(data: bytes) -> Any:
    from libs.model.types import MediaInput, Modality

    return MediaInput(Modality.AUDIO, data)
