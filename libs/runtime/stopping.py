"""Incremental detokenization with stop sequences.

Text that could still turn into a stop sequence is held back; the stop sequence itself is never
returned. `generated_text` always holds all text so far (released + held), which is what moves from
prefill to decode, and the held part is recomputed from it deterministically."""

from __future__ import annotations

from typing import Any


def held_suffix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop sequence."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


class TextStream:
    def __init__(self, tokenizer: Any, stops: tuple[str, ...], generated_text: str, last_token_id: int | None) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.prior_text = generated_text
        # Decoding starts from the previous token so multi-token characters join correctly.
        self.ids: list[int] = [] if last_token_id is None else [last_token_id]
        self.base = self._decode(self.ids)
        if self.base.endswith("\ufffd"):
            # That token's bytes did not decode alone, so `push` held its text back: it is not in
            # `generated_text` yet and must come out with the next tokens (as in one process).
            self.base = ""
        self.text = generated_text
        self.released = len(generated_text) - held_suffix(generated_text, stops)
        # A stop sequence must end past this text offset; None: none is looked for yet (vLLM looks
        # for them only once more than min_tokens tokens were generated, in the text after those).
        self.match_from: int | None = 0

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True)) if ids else ""

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add a token; return (text now safe to release, whether a stop sequence matched)."""
        self.ids.append(token_id)
        decoded = self._decode(self.ids)
        if decoded.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return "", False
        new = decoded[len(self.base) :] if decoded.startswith(self.base) else decoded
        self.text = self.prior_text + new
        search_from = max(0, len(self.prior_text) - max((len(s) for s in self.stops), default=0))
        hits = []
        if self.match_from is not None:
            starts = ((s, max(search_from, self.match_from - len(s) + 1)) for s in self.stops)
            hits = [i for i in (self.text.find(s, start) for s, start in starts) if i >= 0]
        if hits:
            end = min(hits)
            out = self.text[self.released : end]
            self.text = self.text[:end]
            self.released = end
            return out, True
        safe = len(self.text) - held_suffix(self.text, self.stops)
        out = self.text[self.released : safe] if safe > self.released else ""
        self.released = max(self.released, safe)
        return out, False

    def flush(self) -> str:
        """Release everything held back (generation ended without a stop sequence)."""
        out = self.text[self.released :]
        self.released = len(self.text)
        return out


def token_text(tokenizer: Any, token_id: int, context: list[int]) -> str:
    """A token decoded alone, as vLLM reports it in log-probabilities (vllm/v1/engine/logprobs.py
    `_correct_decoded_token`): a token that ends inside a multi-byte character is decoded with up to
    4 preceding generated tokens (`context`); the completing token carries the character (less the
    text of the clean tokens before it), an incomplete one is ""."""
    text = str(tokenizer.decode([token_id]))
    if not text.endswith("\ufffd"):
        return text
    for count in range(1, min(len(context), 4) + 1):
        window = context[-count:]
        full = str(tokenizer.decode([*window, token_id]))
        if full.endswith("\ufffd"):
            continue
        clean_end = len(window)
        while clean_end > 0 and str(tokenizer.decode([window[clean_end - 1]])).endswith("\ufffd"):
            clean_end -= 1
        prefix = str(tokenizer.decode(window[:clean_end])) if clean_end else ""
        if full.startswith(prefix):
            return full[len(prefix) :]
        common = 0
        for a, b in zip(prefix, full, strict=False):
            if a != b:
                break
            common += 1
        return full[common:]
    return ""
