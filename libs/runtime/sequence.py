"""Per-sequence generation state shared by prefill (first token) and decode (the rest)."""

from __future__ import annotations

from collections.abc import Sequence as Ids

import torch

from libs.model.errors import InvalidRequestError
from libs.model.types import FinishReason, SamplingParams, TokenChunk, TokenLogprob, TokenLogprobs
from libs.runtime.lm_runtime import LanguageModelRuntime
from libs.runtime.sampling import (
    apply_penalties,
    check_sampling,
    choose_token,
    resolve_seed,
    suppress,
    top_logprobs,
    uses_penalties,
)
from libs.runtime.stopping import TextStream, token_text


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
        prompt_token_ids: Ids[int] = (),
    ) -> None:
        check_sampling(sampling)
        self.sampling = sampling
        self.seed = resolve_seed(sampling)
        self.max_tokens = runtime.max_new_tokens(prompt_tokens, sampling.max_tokens, default_max_tokens)
        if generated_tokens >= self.max_tokens:
            raise InvalidRequestError("generated_tokens already reaches max_tokens", field="decode_state")
        self.generated = generated_tokens
        self.process = runtime.adapter.process_logits
        self.tokenizer = runtime.tokenizer
        # The tokens generated so far, for logits processors that look back (Whisper's timestamp
        # rules, the penalties). A decode state carries only the last one, which is all of them
        # after prefill.
        self.sampled: list[int] = [] if last_token_id is None else [last_token_id]
        for needs_all, field in ((sampling.timestamps, "timestamp rules"), (uses_penalties(sampling), "penalties")):
            if needs_all and len(self.sampled) != generated_tokens:
                raise InvalidRequestError(
                    f"{field} need every generated token; continue from prefill's first token",
                    field="decode_state.generated_tokens",
                )
        self.prompt_ids: Ids[int] = prompt_token_ids
        self.eos_ids = runtime.eos_token_ids
        # vLLM: EOS ends generation unless ignore_eos; stop_token_ids always do.
        self.stop_ids = frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos else self.eos_ids)
        # vLLM clamps nothing: it refuses min_tokens > max_tokens; ours can exceed a server default.
        self.min_tokens = min(sampling.min_tokens, self.max_tokens)
        self.stream = TextStream(runtime.tokenizer, sampling.stop, generated_text, last_token_id)
        if self.generated < self.min_tokens:
            self.stream.match_from = None  # stop strings are looked for only past min_tokens (vLLM)
        elif self.min_tokens and self.generated == self.min_tokens:
            self.stream.match_from = len(generated_text)
        self.finished: FinishReason | None = None

    def set_prompt(self, prompt_token_ids: Ids[int]) -> None:
        """The prompt's token ids, once built (the repetition penalty looks at them)."""
        self.prompt_ids = prompt_token_ids

    @property
    def text(self) -> str:
        return self.stream.text

    def _scores(self, logits: torch.Tensor) -> torch.Tensor:
        """vLLM's order: the family's processors, min_tokens' suppression, then the penalties."""
        scores = self.process(logits, self.sampled, self.sampling)
        if self.generated < self.min_tokens:
            # vLLM's all_stop_token_ids: EOS (even with ignore_eos) and the stop token ids.
            scores = suppress(scores, self.eos_ids | frozenset(self.sampling.stop_token_ids))
        if uses_penalties(self.sampling):
            scores = apply_penalties(scores.float(), self.sampling, self.prompt_ids, self.sampled)
        return scores

    def _logprobs(self, logits: torch.Tensor, token: int) -> list[TokenLogprobs] | None:
        k = self.sampling.logprobs
        if k is None:
            return None
        chosen, top = top_logprobs(logits, token, k)

        def entry(token_id: int, logprob: float) -> TokenLogprob:
            return TokenLogprob(token_id, logprob, token_text(self.tokenizer, token_id, self.sampled))

        return [TokenLogprobs(entry(token, chosen), tuple(entry(i, v) for i, v in top))]

    def advance(self, logits: torch.Tensor) -> tuple[int, TokenChunk]:
        """Choose the next token from a [vocab] row and report it as a chunk."""
        token = choose_token(self._scores(logits), self.sampling, self.seed, self.generated)
        logprobs = self._logprobs(logits, token)
        self.generated += 1
        self.sampled.append(token)
        if token in self.stop_ids:
            self.finished = FinishReason.STOP
            return token, TokenChunk([token], self.stream.flush(), self.finished, logprobs)
        text, matched = self.stream.push(token)
        if self.min_tokens and self.generated == self.min_tokens:
            self.stream.match_from = len(self.stream.text)
        if matched:
            self.finished = FinishReason.STOP_SEQUENCE
        elif self.generated >= self.max_tokens:
            self.finished = FinishReason.LENGTH
            text += self.stream.flush()
        return token, TokenChunk([token], text, self.finished, logprobs)
