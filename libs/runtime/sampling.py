"""Next-token choice: greedy, or temperature / top-k / top-p sampling from a per-step seeded stream;
before it, vLLM's logits processing (min_tokens, then the repetition, frequency and presence
penalties), and the raw log-probabilities vLLM returns by default.

The generator for step n is seeded from (seed, n), so a sequence sampled in prefill and continued in
another decode process draws the same tokens as one that ran in a single process."""

from __future__ import annotations

import random
from collections.abc import Collection, Iterable

import torch

from libs.model.errors import InvalidRequestError
from libs.model.types import SamplingParams

_MASK64 = (1 << 64) - 1


def check_sampling(params: SamplingParams, *, max_stop: int = 8) -> None:
    if params.temperature < 0:
        raise InvalidRequestError("temperature must be >= 0", field="sampling.temperature")
    if not 0 < params.top_p <= 1:
        raise InvalidRequestError("top_p must be in (0, 1]", field="sampling.top_p")
    if params.top_k < 0:
        raise InvalidRequestError("top_k must be >= 0", field="sampling.top_k")
    if params.max_tokens < 0:
        raise InvalidRequestError("max_tokens must be >= 0", field="sampling.max_tokens")
    if len(params.stop) > max_stop or any(not s for s in params.stop):
        raise InvalidRequestError(f"at most {max_stop} non-empty stop sequences", field="sampling.stop")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2 <= getattr(params, name) <= 2:
            raise InvalidRequestError(f"{name} must be in [-2, 2]", field=f"sampling.{name}")
    if not params.repetition_penalty > 0:
        raise InvalidRequestError("repetition_penalty must be > 0", field="sampling.repetition_penalty")
    if params.min_tokens < 0:
        raise InvalidRequestError("min_tokens must be >= 0", field="sampling.min_tokens")
    if params.logprobs is not None and not 0 <= params.logprobs <= MAX_LOGPROBS:
        raise InvalidRequestError(f"logprobs must be in [0, {MAX_LOGPROBS}]", field="sampling.logprobs")


MAX_LOGPROBS = 20  # vLLM's default max_logprobs


def uses_penalties(params: SamplingParams) -> bool:
    return params.presence_penalty != 0 or params.frequency_penalty != 0 or params.repetition_penalty != 1


def suppress(logits: torch.Tensor, token_ids: Collection[int]) -> torch.Tensor:
    """`logits` with `token_ids` at -inf (vLLM's MinTokensLogitsProcessor while too few tokens)."""
    ids = [t for t in token_ids if 0 <= t < logits.numel()]
    if not ids:
        return logits
    return logits.index_fill(0, torch.tensor(ids, dtype=torch.long), float("-inf"))


def apply_penalties(
    logits: torch.Tensor, params: SamplingParams, prompt_ids: Iterable[int], output_ids: Iterable[int]
) -> torch.Tensor:
    """vLLM's penalties on one float32 [vocab] row, in its order (vllm/model_executor/layers/utils.py
    `apply_penalties`, `_custom_ops.apply_repetition_penalties_torch`): the repetition penalty over
    every token seen in the prompt or the output (a positive logit divided by it, others multiplied),
    then `frequency_penalty` times each token's count in the output, then `presence_penalty` once per
    token present in the output."""
    vocab = logits.numel()
    output = torch.tensor([t for t in output_ids if 0 <= t < vocab], dtype=torch.long)
    if params.repetition_penalty != 1:
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[torch.tensor([t for t in prompt_ids if 0 <= t < vocab], dtype=torch.long)] = True
        seen[output] = True
        penalty = torch.where(seen, torch.tensor(params.repetition_penalty, dtype=torch.float32), 1.0)
        logits = logits * torch.where(logits > 0, 1.0 / penalty, penalty)
    if params.frequency_penalty != 0 or params.presence_penalty != 0:
        counts = torch.bincount(output, minlength=vocab).to(logits.dtype)
        logits = logits - params.frequency_penalty * counts
        logits = logits - params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def top_logprobs(logits: torch.Tensor, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """The chosen token's log-probability and the k most likely (id, log-probability), descending,
    under the raw distribution: log-softmax of the model's float32 logits before any processing
    (vLLM's default `logprobs_mode="raw_logprobs"`)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logprobs, k) if k > 0 else None
    pairs = [] if top is None else [(int(i), float(v)) for v, i in zip(top.values, top.indices, strict=True)]
    return float(logprobs[token]), pairs


def resolve_seed(params: SamplingParams) -> int:
    return params.seed if params.seed is not None else random.getrandbits(63)


def _step_generator(seed: int, step: int) -> torch.Generator:
    mixed = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9) & _MASK64
    return torch.Generator().manual_seed(mixed >> 1)


def choose_token(logits: torch.Tensor, params: SamplingParams, seed: int, step: int) -> int:
    """Pick one token from a [vocab] row of logits."""
    if params.temperature == 0 or params.top_k == 1:
        return int(torch.argmax(logits).item())
    scores = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=_step_generator(seed, step)).item())
