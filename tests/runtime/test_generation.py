"""Sampling, stopping and batched decode behaviour of PrefillRunner + DecodeRunner."""

from __future__ import annotations

import pytest

from libs.model.types import ChatMessage, ChatRole, FinishReason, SamplingParams, TextPart
from libs.runtime.decode_runner import DecodeRunner
from libs.runtime.prefill_runner import PrefillRunner
from libs.runtime.stopping import TextStream, held_suffix

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

PROMPTS = ["hello there", "tell me about the red car and the blue house", "one two three", "what is it"]


def _msg(text: str) -> list[ChatMessage]:
    return [ChatMessage(ChatRole.USER, (TextPart(text),))]


def generate(
    prefill: PrefillRunner, decode: DecodeRunner, prompts: list[str], sampling: SamplingParams
) -> dict[str, tuple[list[int], str, FinishReason | None]]:
    out: dict[str, tuple[list[int], str, FinishReason | None]] = {}
    for i, prompt in enumerate(prompts):
        result = prefill.prefill(_msg(prompt), sampling)
        out[str(i)] = (list(result.first_chunk.token_ids), result.first_chunk.text, result.first_chunk.finish_reason)
        if result.kv_cache is not None:
            decode.add(str(i), result.kv_cache, result.decode_state, sampling)
    for request_id, chunks in decode.run().items():
        tokens, text, _ = out[request_id]
        for chunk, _ in chunks:
            tokens, text = tokens + chunk.token_ids, text + chunk.text
        out[request_id] = (tokens, text, chunks[-1][0].finish_reason)
    return out


def test_batched_greedy_equals_one_at_a_time(omni_prefill: PrefillRunner, omni_decode: DecodeRunner) -> None:
    sampling = SamplingParams(max_tokens=10)
    batched = generate(omni_prefill, omni_decode, PROMPTS, sampling)
    for i, prompt in enumerate(PROMPTS):
        alone = generate(omni_prefill, omni_decode, [prompt], sampling)["0"]
        assert batched[str(i)] == alone


def test_seeded_sampling_is_reproducible_and_batch_independent(
    omni_prefill: PrefillRunner, omni_decode: DecodeRunner
) -> None:
    sampling = SamplingParams(temperature=1.3, top_p=0.95, top_k=50, seed=7, max_tokens=10)
    first = generate(omni_prefill, omni_decode, PROMPTS, sampling)
    again = generate(omni_prefill, omni_decode, PROMPTS[:1], sampling)["0"]
    assert first["0"] == again
    other_seed = generate(omni_prefill, omni_decode, PROMPTS[:1], SamplingParams(**{**sampling.__dict__, "seed": 8}))[
        "0"
    ]
    greedy = generate(omni_prefill, omni_decode, PROMPTS[:1], SamplingParams(max_tokens=10))["0"]
    assert other_seed[0] != first["0"][0] or greedy[0] != first["0"][0]


def test_top_k_one_is_greedy(omni_prefill: PrefillRunner, omni_decode: DecodeRunner) -> None:
    greedy = generate(omni_prefill, omni_decode, PROMPTS[:2], SamplingParams(max_tokens=8))
    top1 = generate(
        omni_prefill, omni_decode, PROMPTS[:2], SamplingParams(temperature=2.0, top_k=1, seed=3, max_tokens=8)
    )
    assert greedy == top1


def test_max_tokens(omni_prefill: PrefillRunner, omni_decode: DecodeRunner) -> None:
    for n in (1, 2, 5):
        tokens, _, finish = generate(omni_prefill, omni_decode, PROMPTS[1:2], SamplingParams(max_tokens=n))["0"]
        assert finish is FinishReason.LENGTH and len(tokens) == n


def test_stop_token_ids(omni_prefill: PrefillRunner, omni_decode: DecodeRunner) -> None:
    tokens, _, _ = generate(omni_prefill, omni_decode, PROMPTS[1:2], SamplingParams(max_tokens=10))["0"]
    stop_id = tokens[3]
    cut, _, finish = generate(
        omni_prefill, omni_decode, PROMPTS[1:2], SamplingParams(max_tokens=10, stop_token_ids=(stop_id,))
    )["0"]
    assert finish is FinishReason.STOP
    assert cut == tokens[: tokens.index(stop_id) + 1]


def test_stop_sequence(omni_prefill: PrefillRunner, omni_decode: DecodeRunner) -> None:
    _, text, _ = generate(omni_prefill, omni_decode, PROMPTS[1:2], SamplingParams(max_tokens=16))["0"]
    assert len(text) >= 6
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    _, cut, finish = generate(omni_prefill, omni_decode, PROMPTS[1:2], SamplingParams(max_tokens=16, stop=(stop,)))["0"]
    assert finish is FinishReason.STOP_SEQUENCE
    assert cut == text[: text.find(stop)]


class _CharTokenizer:
    """Token i decodes to chr(i): enough to exercise the text stream."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def test_text_stream_holds_back_partial_stop_sequences() -> None:
    stream = TextStream(_CharTokenizer(), ("END",), "", None)
    released = [stream.push(ord(c)) for c in "abEN"]
    assert "".join(text for text, _ in released) == "ab"  # "EN" might start "END"
    assert stream.push(ord("x")) == ("ENx", False)
    assert stream.push(ord("E"))[0] == ""
    assert stream.push(ord("N"))[0] == ""
    assert stream.push(ord("D")) == ("", True)
    assert stream.text == "abENx"


def test_text_stream_continues_across_prefill_decode_boundary() -> None:
    # Prefill produced "xE" and held back "E"; decode sees "ND" and must stop without re-emitting.
    assert held_suffix("xE", ("END",)) == 1
    stream = TextStream(_CharTokenizer(), ("END",), "xE", ord("E"))
    assert stream.push(ord("N")) == ("", False)
    assert stream.push(ord("D")) == ("", True)
    assert stream.text == "x"
