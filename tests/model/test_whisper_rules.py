"""The Whisper adapter's logits processing and the long-form window rule against transformers' own
code on random inputs: `process_logits` = generate()'s begin-suppress, suppress and timestamp
processors; `WindowSegmenter` = `WhisperGenerationMixin._retrieve_segment`."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

from libs.model.checkpoint import Checkpoint
from libs.model.checkpoints.generate import ensure_converted
from libs.model.families.whisper import WhisperAdapter
from libs.model.types import SamplingParams
from libs.speech.longform import WindowSegmenter

pytestmark = pytest.mark.integration

BEGIN = 50363  # <|0.00|> in tiny.en
VOCAB = 51864


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread (the reference processors' `isin` over the vocabulary spends most of its
    time waiting on a second thread on a shared machine). Restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def adapter() -> WhisperAdapter:
    return WhisperAdapter(Checkpoint(ensure_converted()))


def _history(rng: random.Random, n: int) -> list[int]:
    """Generated tokens: text, timestamps, pairs, in a plausible mix."""
    out: list[int] = []
    stamp = BEGIN + rng.randrange(5)
    for _ in range(n):
        kind = rng.random()
        if kind < 0.3:
            stamp += rng.randrange(0, 40)
            out.append(min(stamp, VOCAB - 1))
        else:
            out.append(rng.randrange(0, 50256))
    return out


@pytest.mark.parametrize("timestamps", [False, True])
def test_process_logits_equals_generates_processors(adapter: WhisperAdapter, timestamps: bool) -> None:
    from transformers import GenerationConfig
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        SuppressTokensAtBeginLogitsProcessor,
        SuppressTokensLogitsProcessor,
        WhisperTimeStampLogitsProcessor,
    )

    path = ensure_converted()
    config = GenerationConfig.from_pretrained(str(path))
    prompt = adapter.decoder_prompt(SamplingParams(timestamps=timestamps))
    begin_index = len(prompt)
    processors = LogitsProcessorList(
        [
            SuppressTokensAtBeginLogitsProcessor(config.begin_suppress_tokens, begin_index),
            SuppressTokensLogitsProcessor(config.suppress_tokens),
        ]
        + ([WhisperTimeStampLogitsProcessor(config, begin_index)] if timestamps else [])
    )
    rng = random.Random(0)
    torch.manual_seed(0)
    for trial in range(60):
        sampled = _history(rng, rng.choice([0, 0, 1, 2, 3, 7, 20]))
        logits = torch.randn(VOCAB) * 4
        if trial % 3 == 0:
            logits[BEGIN:] += 6  # make the timestamp-mass rule fire sometimes
        ids = torch.tensor([prompt + sampled])
        want = processors(ids, logits.unsqueeze(0).clone())[0]
        got = adapter.process_logits(logits, sampled, SamplingParams(timestamps=timestamps))
        assert torch.equal(got, want), (trial, sampled)


def test_prompt_is_generates_init_tokens(adapter: WhisperAdapter) -> None:
    assert adapter.decoder_prompt(SamplingParams()) == [50257, 50362]
    assert adapter.decoder_prompt(SamplingParams(timestamps=True)) == [50257]


def test_window_segmenter_equals_retrieve_segment() -> None:
    from transformers.models.whisper.generation_whisper import WhisperGenerationMixin

    rng = random.Random(1)
    for trial in range(300):
        tokens = _history(rng, rng.randrange(0, 30))
        if rng.random() < 0.3 and tokens:
            tokens.append(BEGIN + rng.randrange(1500))  # single timestamp ending
        seek, frames = rng.randrange(0, 5000), rng.choice([3000, 1234])
        segments, offset = WhisperGenerationMixin._retrieve_segment(
            seek_sequence=torch.tensor(tokens, dtype=torch.long),
            seek_outputs=[{}],
            time_offset=torch.tensor([seek * 0.01], dtype=torch.float64),
            timestamp_begin=BEGIN,
            seek_num_frames=torch.tensor([frames]),
            time_precision=0.02,
            time_precision_features=0.01,
            input_stride=2,
            prev_idx=0,
            idx=0,
            return_token_timestamps=False,
            decoder_input_ids=torch.tensor([[50257]]),
        )
        ours = WindowSegmenter(BEGIN, seek, frames)
        released = [t for token in tokens for t in ours.push(token)]
        rest, advance = ours.finish()
        kept = [int(t) for s in segments for t in s["tokens"].tolist()]
        assert released + rest == kept, (trial, tokens)
        assert advance == int(offset), (trial, tokens)
        mine = ours.segments()
        assert [list(s.tokens) for s in mine] == [s["tokens"].tolist() for s in segments]
        for a, b in zip(mine, segments, strict=True):
            assert a.start_s == pytest.approx(float(b["start"])) and a.end_s == pytest.approx(float(b["end"]))


def test_a_later_window_is_its_own_encoder_cache_item() -> None:
    """Window 0 hashes as every audio item did before windows existed (the router's content hash);
    a later window of the same clip is another item."""
    from libs.model.content import content_hash, media_hash
    from libs.model.types import MediaInput, Modality, ProcessorOptions

    data = b"RIFF\x00clip bytes"
    first = MediaInput(Modality.AUDIO, data)
    assert media_hash(first) == content_hash(Modality.AUDIO, ProcessorOptions(), data)
    later = MediaInput(Modality.AUDIO, data, audio_window_start_frame=2400)
    assert media_hash(later) != media_hash(first)
    assert media_hash(later) != media_hash(MediaInput(Modality.AUDIO, data, audio_window_start_frame=2402))
