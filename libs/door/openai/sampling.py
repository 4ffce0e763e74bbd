"""The sampling fields OpenAI's chat and completions bodies share (and vLLM's extensions to them
that its clients send: `top_k`, `min_tokens`, `repetition_penalty`, `ignore_eos`,
`stop_token_ids`), as `epd.v1.SamplingParams` (contract 1.6 for the penalties, `min_tokens`,
`ignore_eos` and log-probabilities)."""

from __future__ import annotations

import pydantic

from libs.contract.epd.v1 import sampling_pb2
from libs.door.openai.errors import invalid
from libs.door.openai.fields import Body

MAX_N = 16  # choices per request: each is one Generate call


class SamplingFields(Body):
    temperature: float | None = pydantic.Field(default=None, ge=0, le=2)
    top_p: float | None = pydantic.Field(default=None, gt=0, le=1)
    top_k: int | None = pydantic.Field(default=None, ge=-1)  # vLLM: -1 (or 0) disables it
    n: int = pydantic.Field(default=1, ge=1, le=MAX_N)
    max_tokens: int | None = pydantic.Field(default=None, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = pydantic.Field(default=None, ge=0, lt=1 << 63)
    presence_penalty: float = pydantic.Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = pydantic.Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float | None = pydantic.Field(default=None, gt=0)
    min_tokens: int = pydantic.Field(default=0, ge=0)
    ignore_eos: bool = False

    def sampling(
        self, *, max_tokens: int | None, logprobs: int | None, choice: int, default_temperature: float
    ) -> sampling_pb2.SamplingParams:
        """The contract's sampling for choice `choice`: with a seed, choice i draws from seed + i
        (so the n choices differ and each is reproducible)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stop):
            raise invalid("stop", "stop sequences must be non-empty")
        if max_tokens is not None and self.min_tokens > max_tokens:
            raise invalid("min_tokens", f"{self.min_tokens} is more than the {max_tokens} tokens allowed")
        params = sampling_pb2.SamplingParams(
            temperature=default_temperature if self.temperature is None else self.temperature,
            top_k=max(self.top_k or 0, 0),
            max_tokens=max_tokens or 0,
            stop=stop,
            stop_token_ids=self.stop_token_ids or [],
        )
        # Contract 1.6 fields, set only when asked for (a request without them is a 1.5 request).
        for name in ("presence_penalty", "frequency_penalty", "min_tokens", "ignore_eos"):
            if getattr(self, name):
                setattr(params, name, getattr(self, name))
        if self.top_p is not None:
            params.top_p = self.top_p
        if self.seed is not None:
            params.seed = (self.seed + choice) % (1 << 63)
        if self.repetition_penalty is not None:
            params.repetition_penalty = self.repetition_penalty
        if logprobs is not None:
            params.logprobs = logprobs
        return params
