"""Contract 1.6's sampling math in the reference runtime, with vLLM's semantics: the repetition
penalty over prompt + output tokens (a positive logit divided, a negative one multiplied), the
frequency penalty per output occurrence, the presence penalty once per output token, in that order;
min_tokens' suppression of EOS and the stop token ids; raw log-probabilities (log-softmax of the
unprocessed logits). The vLLM-marked test checks the same rows against vLLM's own functions."""

from __future__ import annotations

import math

import pytest
import torch

from libs.model.errors import InvalidRequestError
from libs.model.types import SamplingParams
from libs.runtime.sampling import apply_penalties, check_sampling, suppress, top_logprobs
from libs.runtime.stopping import TextStream


class _CharTokenizer:
    """Token i decodes to chr(ord('a') + i)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


ROW = torch.tensor([2.0, -1.0, 0.5, -0.5, 3.0, 0.0], dtype=torch.float32)


@pytest.mark.unit
def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens() -> None:
    out = apply_penalties(ROW.clone(), SamplingParams(repetition_penalty=2.0), prompt_ids=[0, 1], output_ids=[3])
    # 0 (prompt, positive) halved, 1 (prompt, negative) doubled, 3 (output, negative) doubled.
    assert out.tolist() == [1.0, -2.0, 0.5, -1.0, 3.0, 0.0]


@pytest.mark.unit
def test_frequency_counts_output_occurrences_and_presence_counts_once_and_the_prompt_not_at_all() -> None:
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(ROW.clone(), params, prompt_ids=[0, 4], output_ids=[2, 2, 2, 5])
    expected = ROW.clone()
    expected[2] -= 3 * 0.5 + 0.25
    expected[5] -= 1 * 0.5 + 0.25
    assert torch.equal(out, expected)  # tokens 0 and 4 (prompt only) untouched


@pytest.mark.unit
def test_penalties_apply_in_vllms_order_repetition_first() -> None:
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0)
    out = apply_penalties(ROW.clone(), params, prompt_ids=[], output_ids=[4])
    assert out[4].item() == 3.0 / 2 - 1.0  # divided, then the frequency subtracted (not (3 - 1) / 2)


@pytest.mark.unit
def test_off_penalties_leave_the_row_alone_and_ids_beyond_the_vocab_are_ignored() -> None:
    assert torch.equal(apply_penalties(ROW.clone(), SamplingParams(), [0, 1], [2]), ROW)
    out = apply_penalties(ROW.clone(), SamplingParams(repetition_penalty=2.0, presence_penalty=1.0), [99], [99])
    assert torch.equal(out, ROW)


@pytest.mark.unit
def test_min_tokens_suppression_sets_the_stop_ids_to_minus_infinity() -> None:
    out = suppress(ROW.clone(), {4, 1, 77})
    assert out[4].item() == -math.inf and out[1].item() == -math.inf
    assert int(torch.argmax(out)) == 0


@pytest.mark.unit
def test_raw_logprobs_are_the_log_softmax_of_the_unprocessed_logits_top_k_descending() -> None:
    chosen, top = top_logprobs(ROW, token=2, k=3)
    expected = torch.log_softmax(ROW, dim=-1)
    assert chosen == pytest.approx(float(expected[2]))
    assert [i for i, _ in top] == [4, 0, 2]
    assert [v for _, v in top] == pytest.approx([float(expected[i]) for i in (4, 0, 2)])
    assert top_logprobs(ROW, token=1, k=0) == (pytest.approx(float(expected[1])), [])


@pytest.mark.unit
@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(presence_penalty=2.5), "sampling.presence_penalty"),
        (SamplingParams(frequency_penalty=-3.0), "sampling.frequency_penalty"),
        (SamplingParams(repetition_penalty=0.0), "sampling.repetition_penalty"),
        (SamplingParams(min_tokens=-1), "sampling.min_tokens"),
        (SamplingParams(logprobs=21), "sampling.logprobs"),
    ],
)
def test_out_of_range_values_are_refused_naming_the_field(params: SamplingParams, field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        check_sampling(params)
    assert info.value.field == field


@pytest.mark.unit
def test_stop_sequences_are_matched_only_past_min_tokens_text() -> None:
    stream = TextStream(_CharTokenizer(), ("b",), "", None)
    stream.match_from = None  # within min_tokens: no match
    assert stream.push(1) == ("b", False)
    stream.match_from = len(stream.text)  # min_tokens reached: only text after offset 1 counts
    assert stream.push(2) == ("c", False)
    assert stream.push(1) == ("", True)
    assert stream.text == "bc"


@pytest.mark.vllm
def test_the_math_equals_vllms_own_functions() -> None:
    """vLLM's apply_penalties (the torch repetition op on CPU) and its sampler's logprobs on random
    rows: the reference runtime's results are bit-identical."""
    from vllm.model_executor.layers.utils import apply_penalties as vllm_penalties
    from vllm.v1.sample.sampler import Sampler

    generator = torch.Generator().manual_seed(0)
    vocab = 64
    logits = torch.randn(3, vocab, generator=generator) * 4
    prompts = [[1, 2, 3, 2], [5], [7, 8]]
    outputs = [[2, 2, 9, 40], [5, 5, 5], []]
    cases = [(1.3, 0.5, -0.25), (0.7, -1.0, 2.0), (1.0, 0.0, 0.0)]  # (repetition, frequency, presence)

    def padded(rows: list[list[int]]) -> torch.Tensor:
        width = max(len(r) for r in rows)
        return torch.tensor([r + [vocab] * (width - len(r)) for r in rows], dtype=torch.long)

    theirs = vllm_penalties(
        logits.clone(),
        padded(prompts),
        padded(outputs),
        torch.tensor([c[2] for c in cases]),
        torch.tensor([c[1] for c in cases]),
        torch.tensor([c[0] for c in cases]),
    )
    for row, (rep, freq, pres) in enumerate(cases):
        params = SamplingParams(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres)
        ours = apply_penalties(logits[row].clone(), params, prompts[row], outputs[row])
        assert torch.equal(ours, theirs[row]), row
    raw = Sampler.compute_logprobs(logits)
    for row in range(3):
        token = int(torch.argmax(logits[row]))
        chosen, top = top_logprobs(logits[row], token, 5)
        assert chosen == float(raw[row, token])
        assert [v for _, v in top] == torch.topk(raw[row], 5).values.tolist()


class _Runtime:
    """What `Sequence` reads of a runtime: a vocabulary of 6, token 5 the end of sequence."""

    eos_token_ids = frozenset({5})
    tokenizer = _CharTokenizer()

    class adapter:
        @staticmethod
        def process_logits(logits: torch.Tensor, sampled: list[int], sampling: SamplingParams) -> torch.Tensor:
            return logits

    @staticmethod
    def max_new_tokens(prompt_tokens: int, max_tokens: int, default: int) -> int:
        return max_tokens or default


def _run(sampling: SamplingParams, steps: int, **kw: object) -> list[tuple[int, str | None]]:
    from libs.runtime.sequence import Sequence

    sequence = Sequence(_Runtime(), sampling, default_max_tokens=16, **kw)  # type: ignore[arg-type]
    row = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0, 5.0])  # EOS is the greedy choice
    out = []
    for _ in range(steps):
        token, chunk = sequence.advance(row.clone())
        out.append((token, None if chunk.finish_reason is None else chunk.finish_reason.value))
        if chunk.finish_reason is not None:
            break
    return out


@pytest.mark.unit
def test_eos_ends_generation_unless_ignore_eos_and_min_tokens_holds_it_back() -> None:
    assert _run(SamplingParams(max_tokens=4), 4) == [(5, "stop")]
    # ignore_eos: EOS is still chosen, it just does not end generation (vLLM's ignore_eos).
    assert _run(SamplingParams(max_tokens=3, ignore_eos=True), 4) == [(5, None), (5, None), (5, "length")]
    # min_tokens: EOS suppressed for the first 2 tokens, then it ends generation.
    assert _run(SamplingParams(max_tokens=8, min_tokens=2), 8) == [(1, None), (1, None), (5, "stop")]
    # Continued after prefill's token (decode): the count goes on from generated_tokens.
    continued = _run(SamplingParams(max_tokens=8, min_tokens=2), 8, generated_tokens=1, last_token_id=1)
    assert continued == [(1, None), (5, "stop")]


@pytest.mark.unit
def test_logprobs_come_with_every_token_and_penalties_need_every_generated_token() -> None:
    from libs.runtime.sequence import Sequence

    sequence = Sequence(_Runtime(), SamplingParams(max_tokens=4, logprobs=2), default_max_tokens=16)  # type: ignore[arg-type]
    _, chunk = sequence.advance(torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0, 5.0]))
    assert chunk.logprobs is not None and len(chunk.logprobs) == 1
    (entry,) = chunk.logprobs
    assert entry.chosen.token_id == 5 and entry.chosen.token == "f"
    assert [t.token_id for t in entry.top] == [5, 1]
    with pytest.raises(InvalidRequestError) as info:
        Sequence(
            _Runtime(),  # type: ignore[arg-type]
            SamplingParams(presence_penalty=1.0),
            default_max_tokens=16,
            generated_tokens=3,
            last_token_id=1,
        )
    assert info.value.field == "decode_state.generated_tokens"


class _ByteTokenizer:
    """Token i is the byte i (a character of several bytes takes several tokens)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.unit
def test_a_token_inside_a_multibyte_character_reports_empty_text_and_the_last_one_the_character() -> None:
    from libs.runtime.stopping import token_text

    tokenizer = _ByteTokenizer()
    first, second = "é".encode()  # two bytes: two tokens
    assert token_text(tokenizer, ord("a"), []) == "a"
    assert token_text(tokenizer, first, [ord("a")]) == ""  # incomplete: vLLM reports ""
    assert token_text(tokenizer, second, [ord("a"), first]) == "é"  # the completing token carries it
