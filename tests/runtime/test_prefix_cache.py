"""The reference engine's prefix cache (libs/runtime/prefix_cache.py) on a conversation that keeps
its image across turns, as a chat client sends it: a later turn starts from the blocks of the
earlier ones, images included, and answers with the same greedy tokens as a prefill from nothing;
another tenant's salt or another image with the same layout finds nothing of it; the cache stays
within its byte budget."""

from __future__ import annotations

import pytest
import torch

from libs.model.errors import PrefixMissError
from libs.model.media import synthetic
from libs.model.types import (
    ChatMessage,
    ChatRole,
    EncodedItem,
    EncodedPart,
    MediaInput,
    Modality,
    SamplingParams,
    TextPart,
)
from libs.runtime.decode_runner import DecodeRunner
from libs.runtime.encoder_runner import EncoderRunner
from libs.runtime.lm_runtime import LanguageModelRuntime
from libs.runtime.prefill_runner import PrefillRunner, PrefillTask
from libs.runtime.prefix_cache import PrefixCache

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

GREEDY = SamplingParams(max_tokens=6)
BUDGET = 64 << 20
# Short prompts: small blocks, as long as the prefill chunks (what makes reuse exact).
BLOCK = 16


@pytest.fixture(scope="module")
def images(omni_encoder: EncoderRunner) -> list[EncodedItem]:
    # Two images of one size: the same placeholder tokens, other rows.
    return omni_encoder.encode([MediaInput(Modality.IMAGE, synthetic.png_bytes(56, 56, seed=s)) for s in (0, 1)])


def _turns(image: EncodedItem, answers: list[str]) -> list[list[ChatMessage]]:
    """The conversation as a chat client resends it at each turn: every message so far."""
    questions = ["what is in the picture", "and its colours", "say it again"]
    conversation: list[ChatMessage] = []
    turns = []
    for i, question in enumerate(questions[: len(answers) + 1]):
        parts = (EncodedPart(image), TextPart(question)) if i == 0 else (TextPart(question),)
        conversation = [*conversation, ChatMessage(ChatRole.USER, parts)]
        turns.append(conversation)
        if i < len(answers):
            conversation = [*conversation, ChatMessage(ChatRole.ASSISTANT, (TextPart(answers[i]),))]
    return turns


def _answer(
    runner: PrefillRunner, decode: DecodeRunner, messages: list[ChatMessage], salt: str = ""
) -> tuple[list[int], str, int]:
    """Greedy tokens and text of one turn (prefill, then decode), and the prompt tokens reused."""
    task = runner.start(messages, GREEDY, cache_salt=salt)
    assert isinstance(task, PrefillTask)
    while not task.step(runner.chunk_tokens):
        pass
    result = task.finish()
    tokens, text = list(result.first_chunk.token_ids), result.first_chunk.text
    if result.kv_cache is not None:
        decode.add("r", result.kv_cache, result.decode_state, GREEDY)
        for chunk, _ in decode.run()["r"]:
            tokens, text = tokens + chunk.token_ids, text + chunk.text
    return tokens, text, task.cached_tokens


def _prompt_tokens(runner: PrefillRunner, messages: list[ChatMessage]) -> int:
    return len(runner.build(messages).input_ids)


def test_later_turns_reuse_the_conversation_and_answer_the_same(
    omni_runtime: LanguageModelRuntime, omni_decode: DecodeRunner, images: list[EncodedItem]
) -> None:
    plain = PrefillRunner(omni_runtime, chunk_tokens=BLOCK)
    cached = PrefillRunner(omni_runtime, chunk_tokens=BLOCK, prefix_cache=PrefixCache(BUDGET, block_tokens=BLOCK))
    answers: list[str] = []
    for turn in range(3):
        messages = _turns(images[0], answers)[turn]
        tokens, text, _ = _answer(plain, omni_decode, messages)
        again, _, reused = _answer(cached, omni_decode, messages)
        assert again == tokens, f"turn {turn}: tokens with reuse differ from a prefill from nothing"
        if turn == 0:
            assert reused == 0
        else:  # every complete block of the previous turn's prompt (which this one starts with)
            previous = _prompt_tokens(plain, _turns(images[0], answers[:-1])[turn - 1])
            assert reused == previous // BLOCK * BLOCK > 0
        answers.append(text)
    stats = cached.prefix_cache.stats if cached.prefix_cache else None
    assert stats is not None and stats.queries == 3 and stats.hit_tokens > 0


def test_another_salt_or_another_image_reuses_nothing_of_it(
    omni_runtime: LanguageModelRuntime, omni_decode: DecodeRunner, images: list[EncodedItem]
) -> None:
    runner = PrefillRunner(omni_runtime, chunk_tokens=BLOCK, prefix_cache=PrefixCache(BUDGET, block_tokens=BLOCK))
    _answer(runner, omni_decode, _turns(images[0], [])[0], salt="tenant-a")
    follow_up = _turns(images[0], ["it is a picture"])[1]
    assert _answer(runner, omni_decode, follow_up, salt="tenant-b")[2] == 0
    # The same placeholders with another image's rows: reuse stops at the first block holding a row.
    other = _turns(images[1], ["it is a picture"])[1]
    image_start = runner.build(other).items[0].start
    _, _, reused = _answer(runner, omni_decode, other, salt="tenant-a")
    assert reused == image_start // BLOCK * BLOCK
    assert _answer(runner, omni_decode, follow_up, salt="tenant-a")[2] > image_start


def test_the_cache_stays_within_its_budget(
    omni_runtime: LanguageModelRuntime, omni_decode: DecodeRunner, images: list[EncodedItem]
) -> None:
    plain = PrefillRunner(omni_runtime, chunk_tokens=BLOCK)
    asks = [_turns(image, [])[0] for image in images]
    expected = [_answer(plain, omni_decode, messages)[0] for messages in asks]
    probe = PrefixCache(BUDGET, block_tokens=BLOCK)
    _answer(PrefillRunner(omni_runtime, chunk_tokens=BLOCK, prefix_cache=probe), omni_decode, asks[0])
    small = PrefixCache(2 * probe.bytes // len(probe), block_tokens=BLOCK)  # two blocks
    runner = PrefillRunner(omni_runtime, chunk_tokens=BLOCK, prefix_cache=small)
    for messages, tokens in zip(asks * 2, expected * 2, strict=True):
        assert _answer(runner, omni_decode, messages)[0] == tokens
        assert small.bytes <= small.budget_bytes and len(small) <= 2
    assert small.stats.evicted_blocks > 0


def _held(item: EncodedItem) -> EncodedItem:
    """The item as a prefill gets it when sent as held (contract 1.9): its layout, zeros for rows."""
    return EncodedItem(item.layout, {name: torch.zeros_like(t) for name, t in item.tensors.items()}, held=True)


def test_a_held_item_answers_from_the_cache_or_is_refused(
    omni_runtime: LanguageModelRuntime, omni_decode: DecodeRunner, images: list[EncodedItem]
) -> None:
    """A later turn whose image is sent as held (no embeddings) answers exactly as with them when the
    cache covers the image; when it does not (another tenant, evicted), the prefill refuses with
    PrefixMissError before forwarding anything, never on zeros."""
    plain = PrefillRunner(omni_runtime, chunk_tokens=BLOCK)
    runner = PrefillRunner(omni_runtime, chunk_tokens=BLOCK, prefix_cache=PrefixCache(BUDGET, block_tokens=BLOCK))
    assert runner.holds_items and not plain.holds_items
    first = _turns(images[0], [])[0]
    _, answer, _ = _answer(runner, omni_decode, first, salt="tenant-a")
    later = _turns(images[0], [answer])[1]
    held = _turns(_held(images[0]), [answer])[1]
    expected, _, _ = _answer(plain, omni_decode, later)
    tokens, _, reused = _answer(runner, omni_decode, held, salt="tenant-a")
    assert tokens == expected, "a held image answered differently from its embeddings"
    assert reused >= runner.build(held).items[0].start + images[0].layout.placeholder_token_count
    with pytest.raises(PrefixMissError, match=r"items\[0\] was sent as held"):
        runner.start(held, GREEDY, cache_salt="tenant-b")
    with pytest.raises(PrefixMissError):
        plain.start(held, GREEDY)
