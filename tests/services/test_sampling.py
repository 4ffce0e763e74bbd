"""Sampling through the services of every layout (the session stacks): a seeded temperature sample
is reproducible, the same in every layout (the seed stream continues from prefill into another
decode process), and not the greedy answer; stop sequences and stop token ids end the stream where
the greedy text and tokens say; the streamed text is the tokenizer's decoding of the streamed tokens.
Contract 1.6's fields give transformers' generate() answers where it has the knob (repetition
penalty, min_new_tokens, raw logits for the log-probabilities), and the OpenAI definition's for the
frequency and presence penalties, in every layout (the split ones across the P->D handoff)."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from libs.client.generate import GenerationResult
from libs.contract.epd.v1 import generate_pb2
from libs.launch.stack import Stack
from libs.runtime.stopping import token_text
from tests.support.golden import request_for
from tests.support.reference import load_reference, reference_inputs
from tests.support.stacks import MIXES, layout_slug, run_requests

pytestmark = pytest.mark.stack

LAYOUTS = ["colocated", "e+pd", "e/p/d"]
TOKENS = 24


@cache
def _tokenizer(model_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(model_path))  # the checkpoint's own tokenizer files


def _request(name: str, request_id: str, **sampling: Any) -> generate_pb2.GenerateRequest:
    request = request_for(MIXES[name], max_tokens=TOKENS, request_id=request_id)
    for key, value in sampling.items():
        if isinstance(value, list):
            getattr(request.sampling, key).extend(value)
        else:
            setattr(request.sampling, key, value)
    return request


def _one(stack: Stack, request: generate_pb2.GenerateRequest) -> GenerationResult:
    (result,) = run_requests(stack.address, [request])
    return result


@pytest.mark.timeout(300)
def test_seeded_sampling_is_reproducible_in_every_layout_and_not_greedy(stacks: Callable[[str], Stack]) -> None:
    seeded: dict[str, list[list[int]]] = {}
    for layout in LAYOUTS:
        stack = stacks(layout)
        requests = [_request("image", f"seed7-{i}", temperature=1.0, seed=7) for i in range(2)] + [
            _request("image", "seed8", temperature=1.0, seed=8)
        ]
        seeded[layout] = [r.token_ids for r in run_requests(stack.address, requests)]
        greedy = _one(stack, _request("image", "greedy")).token_ids
        same_a, same_b, other_seed = seeded[layout]
        assert same_a == same_b, layout  # same seed, same tokens (two concurrent requests)
        assert other_seed != same_a, layout  # another seed, another sample
        assert same_a != greedy, layout  # temperature 1 does sample
    # The seed stream is the same wherever the steps run: prefill's process, then decode's.
    assert seeded["e+pd"][0] == seeded["e/p/d"][0] == seeded["colocated"][0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_streamed_text_is_the_decoding_of_the_streamed_tokens(
    layout: str, stacks: Callable[[str], Stack], model_path: Path
) -> None:
    stack = stacks(layout)
    names = sorted(MIXES)
    results = run_requests(stack.address, [_request(n, f"text-{n}", temperature=0.8, seed=3) for n in names])
    for name, result in zip(names, results, strict=True):
        assert len(result.token_ids) == TOKENS or result.finish_reason == "FINISH_REASON_STOP", name
        assert result.text == _tokenizer(model_path).decode(result.token_ids, skip_special_tokens=True), name


def _stop_inside(text: str) -> str:
    """A stop sequence that first occurs well inside `text` (so generation stops early)."""
    for start in range(len(text) // 3, len(text) - 2):
        candidate = text[start : start + 2]
        if candidate.strip() and text.find(candidate) == start:
            return candidate
    raise AssertionError(f"no usable stop sequence in {text!r}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_stop_sequence_ends_the_stream_before_it(layout: str, stacks: Callable[[str], Stack], model_path: Path) -> None:
    stack = stacks(layout)
    greedy = _one(stack, _request("audio_image", f"stopseq-greedy-{layout_slug(layout)}"))
    stop = _stop_inside(greedy.text)
    result = _one(stack, _request("audio_image", f"stopseq-{layout_slug(layout)}", stop=[stop, "never appears \x01"]))
    assert result.finish_reason == "FINISH_REASON_STOP_SEQUENCE"
    assert result.text == greedy.text[: greedy.text.find(stop)]  # the text before it, without it
    n = len(result.token_ids)
    assert 0 < n < len(greedy.token_ids) and result.token_ids == greedy.token_ids[:n]
    decode = _tokenizer(model_path).decode
    # Its last token completed the stop sequence: without it, the text does not hold it yet.
    assert stop in decode(result.token_ids, skip_special_tokens=True)
    assert stop not in decode(result.token_ids[:-1], skip_special_tokens=True)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_stop_token_id_ends_the_stream_at_it(layout: str, stacks: Callable[[str], Stack], model_path: Path) -> None:
    stack = stacks(layout)
    for name in sorted(MIXES):  # a mix whose greedy tokens have a new token past the first two
        greedy = _one(stack, _request(name, f"stopid-greedy-{name}-{layout_slug(layout)}")).token_ids
        fresh = [i for i in range(2, len(greedy)) if greedy[i] not in greedy[:i]]
        if fresh:
            break
    else:
        raise AssertionError("every mix repeats its first tokens")
    at = fresh[0]  # past prefill's token and decode's first: the stop is seen in decode
    result = _one(stack, _request(name, f"stopid-{layout_slug(layout)}", stop_token_ids=[greedy[at]]))
    assert result.finish_reason == "FINISH_REASON_STOP"
    assert result.token_ids == greedy[: at + 1]  # up to and with the stop token
    assert result.text == _tokenizer(model_path).decode(greedy[:at], skip_special_tokens=True)  # not its text


# --- contract 1.6: penalties, min_tokens, ignore_eos, logprobs, against transformers' generate() ---


@cache
def _hf_model(model_path: Path) -> Any:
    return load_reference(str(model_path))


def _hf_generate(model_path: Path, name: str, **kwargs: Any) -> Any:
    inputs = reference_inputs(model_path, MIXES[name])
    with torch.inference_mode():
        out = _hf_model(model_path).generate(
            **inputs, max_new_tokens=TOKENS, do_sample=False, return_dict_in_generate=True, **kwargs
        )
    return out, inputs["input_ids"].shape[1]


class _OpenAIPenalties:
    """The frequency and presence penalties as OpenAI (and vLLM) define them, over the generated
    tokens only: an oracle written from the definition, for transformers, which has no such knob."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.bincount(input_ids[0, self.prompt_len :], minlength=scores.shape[-1]).to(scores.dtype)
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


@pytest.mark.timeout(300)
def test_repetition_penalty_and_min_tokens_match_transformers_generate(
    stacks: Callable[[str], Stack], model_path: Path
) -> None:
    greedy, _ = _hf_generate(model_path, "text")
    prompt_len = _hf_generate(model_path, "text")[1]
    tokens = greedy.sequences[0, prompt_len:].tolist()
    repeated, _ = _hf_generate(model_path, "text", repetition_penalty=1.3)
    want_repeated = repeated.sequences[0, prompt_len:].tolist()
    assert want_repeated != tokens  # the knob changes this answer
    # A stop token id first generated at `at`, held back by min_tokens past it: decode's count
    # of generated tokens continues prefill's.
    at = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    eos = list(_hf_model(model_path).generation_config.eos_token_id)
    held, _ = _hf_generate(model_path, "text", eos_token_id=[*eos, tokens[at]], min_new_tokens=at + 2)
    want_held = held.sequences[0, prompt_len:].tolist()
    assert want_held[: at + 1] != tokens[: at + 1]
    for layout in LAYOUTS:
        stack = stacks(layout)
        slug = layout_slug(layout)
        assert _one(stack, _request("text", f"rep-{slug}", repetition_penalty=1.3)).token_ids == want_repeated, layout
        result = _one(stack, _request("text", f"min-{slug}", stop_token_ids=[tokens[at]], min_tokens=at + 2))
        assert result.token_ids == want_held, layout
        assert len(result.token_ids) >= at + 2, layout
        # ignore_eos keeps stop token ids working (and is accepted everywhere).
        ignored = _one(stack, _request("text", f"noeos-{slug}", stop_token_ids=[tokens[at]], ignore_eos=True))
        assert ignored.token_ids == tokens[: at + 1] and ignored.finish_reason == "FINISH_REASON_STOP", layout


@pytest.mark.timeout(300)
def test_frequency_and_presence_penalties_match_their_definition(
    stacks: Callable[[str], Stack], model_path: Path
) -> None:
    prompt_len = _hf_generate(model_path, "image")[1]
    want, _ = _hf_generate(
        model_path, "image", logits_processor=[_OpenAIPenalties(prompt_len, frequency=0.75, presence=0.5)]
    )
    plain, _ = _hf_generate(model_path, "image")
    assert want.sequences[0, prompt_len:].tolist() != plain.sequences[0, prompt_len:].tolist()
    for layout in LAYOUTS:
        got = _one(
            stacks(layout),
            _request("image", f"freq-{layout_slug(layout)}", frequency_penalty=0.75, presence_penalty=0.5),
        )
        assert got.token_ids == want.sequences[0, prompt_len:].tolist(), layout


@pytest.mark.timeout(300)
def test_logprobs_are_the_raw_log_softmax_of_transformers_logits(
    stacks: Callable[[str], Stack], model_path: Path
) -> None:
    out, prompt_len = _hf_generate(model_path, "image", output_logits=True)
    tokens = out.sequences[0, prompt_len:].tolist()
    raw = [torch.log_softmax(step[0].float(), dim=-1) for step in out.logits]
    tokenizer = _tokenizer(model_path)
    for layout in LAYOUTS:
        result = _one(stacks(layout), _request("image", f"logprobs-{layout_slug(layout)}", logprobs=3))
        assert result.token_ids == tokens, layout
        assert len(result.logprobs) == len(tokens), layout  # one per token, across the P->D handoff
        for step, (token, entry) in enumerate(zip(tokens, result.logprobs, strict=True)):
            assert entry.chosen.token_id == token and entry.chosen.token == token_text(tokenizer, token, tokens[:step])
            assert entry.chosen.logprob == pytest.approx(float(raw[step][token]), abs=2e-3), (layout, step)
            assert [t.token_id for t in entry.top] == torch.topk(raw[step], 3).indices.tolist(), (layout, step)
            assert [t.logprob for t in entry.top] == sorted((t.logprob for t in entry.top), reverse=True)
            assert entry.top[0].token_id == token  # greedy: the chosen one is the most likely
        none = _one(stacks(layout), _request("image", f"nologprobs-{layout_slug(layout)}"))
        assert none.logprobs == [], layout
