"""Next-token choice: greedy, or temperature / top-k / top-p sampling from a per-step seeded stream.

The generator for step n is seeded from (seed, n), so a sequence sampled in prefill and continued in
another decode process draws the same tokens as one that ran in a single process."""

from __future__ import annotations

import random

import torch

from libs.runtime.errors import InvalidRequestError
from libs.runtime.types import SamplingParams

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
