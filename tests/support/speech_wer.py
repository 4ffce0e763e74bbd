"""Word error rate with Whisper's English text normalizer (transformers' `EnglishTextNormalizer`,
without the hub's spelling map): the usual way Whisper transcripts are scored."""

from __future__ import annotations

from functools import cache
from typing import Any


@cache
def _normalizer() -> Any:
    from transformers.models.whisper.english_normalizer import EnglishTextNormalizer

    return EnglishTextNormalizer({})


def words(text: str) -> list[str]:
    return str(_normalizer()(text)).split()


def edit_distance(ref: list[str], hyp: list[str]) -> int:
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[-1]


def word_error_rate(reference: str, hypothesis: str) -> float:
    ref = words(reference)
    return edit_distance(ref, words(hypothesis)) / max(1, len(ref))


def corpus_wer(pairs: list[tuple[str, str]]) -> float:
    """Total edits over total reference words (not a mean of per-sentence rates)."""
    edits = sum(edit_distance(words(r), words(h)) for r, h in pairs)
    return edits / max(1, sum(len(words(r)) for r, _ in pairs))
