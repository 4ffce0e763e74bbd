"""Per-sequence generation state shared by prefill (first token) and decode (the rest)."""

from __future__ import annotations

import torch

from libs.runtime.errors import InvalidRequestError
from libs.runtime.lm_runtime import LanguageModelRuntime
from libs.runtime.sampling import check_sampling, choose_token, resolve_seed
from libs.runtime.stopping import TextStream
from libs.runtime.types import FinishReason, SamplingParams, TokenChunk


class Sequence:
    def __init__(
        self,
        runtime: LanguageModelRuntime,
        sampling: SamplingParams,
        *,
        default_max_tokens: int,
        generated_tokens: int = 0,
        generated_text: str = "",
        last_token_id: int | None = None,
        prompt_tokens: int = 0,
    ) -> None:
        check_sampling(sampling)
        self.sampling = sampling
        self.seed = resolve_seed(sampling)
        self.max_tokens = runtime.max_new_tokens(prompt_tokens, sampling.max_tokens, default_max_tokens)
        if generated_tokens >= self.max_tokens:
            raise InvalidRequestError("generated_tokens already reaches max_tokens", field="decode_state")
        self.generated = generated_tokens
        self.process = runtime.adapter.process_logits
        # The tokens generated so far, for logits processors that look back (Whisper's timestamp
        # rules). A decode state carries only the last one, which is all of them after prefill.
        self.sampled: list[int] = [] if last_token_id is None else [last_token_id]
        if sampling.timestamps and len(self.sampled) != generated_tokens:
            raise InvalidRequestError(
                "timestamp rules need every generated token; continue from prefill's first token",
                field="decode_state.generated_tokens",
            )
        self.stop_ids = runtime.eos_token_ids | frozenset(sampling.stop_token_ids)
        self.stream = TextStream(runtime.tokenizer, sampling.stop, generated_text, last_token_id)
        self.finished: FinishReason | None = None

    @property
    def text(self) -> str:
        return self.stream.text

    def advance(self, logits: torch.Tensor) -> tuple[int, TokenChunk]:
        """Choose the next token from a [vocab] row and report it as a chunk."""
        token = choose_token(
            self.process(logits, self.sampled, self.sampling), self.sampling, self.seed, self.generated
        )
        self.generated += 1
        self.sampled.append(token)
        if token in self.stop_ids:
            self.finished = FinishReason.STOP
            return token, TokenChunk([token], self.stream.flush(), self.finished)
        text, matched = self.stream.push(token)
        if matched:
            self.finished = FinishReason.STOP_SEQUENCE
        elif self.generated >= self.max_tokens:
            self.finished = FinishReason.LENGTH
            text += self.stream.flush()
        return token, TokenChunk([token], text, self.finished)
