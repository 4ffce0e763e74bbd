"""The sampling fields OpenAI's chat and completions bodies share (and vLLM's extensions to them
that its clients send: `top_k`, `min_tokens`, `repetition_penalty`, `ignore_eos`,
`stop_token_ids`), as `epd.v1.SamplingParams` (contract 1.6 for the penalties, `min_tokens`,
`ignore_eos` and log-probabilities)."""

from __future__ import annotations

import re
from typing import Any

import pydantic

from libs.contract.epd.v1 import sampling_pb2
from libs.contract.errors import InvalidArgument
from libs.contract.validation import DEFAULT_LIMITS, Limits, sampling_params
from libs.door.openai.errors import invalid
from libs.door.openai.fields import Body

MAX_N = 16  # choices per request: each is one Generate call
_CONTRACT_PATH = re.compile(r"^sampling\.(\w+)(?:\[(\d+)\])?")


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
        self,
        *,
        max_tokens: int | None,
        logprobs: int | None,
        choice: int,
        default_temperature: float,
        fields: dict[str, str],
        limits: Limits = DEFAULT_LIMITS,
    ) -> sampling_pb2.SamplingParams:
        """The contract's sampling for choice `choice`: with a seed, choice i draws from seed + i
        (so the n choices differ and each is reproducible). Refused as the router refuses it
        (`libs.contract.validation.sampling_params`: each value within its field's width, then the
        router's own checks), the error naming the body's field: `fields` maps the contract's
        names this endpoint fills from another field (`max_tokens` from `max_completion_tokens`)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        values: dict[str, Any] = {
            "temperature": default_temperature if self.temperature is None else self.temperature,
            "top_k": max(self.top_k or 0, 0),
            "max_tokens": max_tokens or 0,
            "stop": stop,
            "stop_token_ids": self.stop_token_ids or [],
        }
        # Contract 1.6 fields, set only when asked for (a request without them is a 1.5 request).
        for name in ("presence_penalty", "frequency_penalty", "min_tokens", "ignore_eos"):
            if getattr(self, name):
                values[name] = getattr(self, name)
        if self.top_p is not None:
            values["top_p"] = self.top_p
        if self.seed is not None:
            values["seed"] = (self.seed + choice) % (1 << 63)
        if self.repetition_penalty is not None:
            values["repetition_penalty"] = self.repetition_penalty
        if logprobs is not None:
            values["logprobs"] = logprobs
        try:
            return sampling_params(values, "sampling", limits)
        except InvalidArgument as exc:
            raise invalid(self._body_field(exc.field, fields), exc.problem) from None

    def _body_field(self, path: str, fields: dict[str, str]) -> str:
        """The body's field a contract path (`sampling.stop[1]`) was filled from (`stop[1]`)."""
        match = _CONTRACT_PATH.match(path)
        if match is None:
            return path
        name, index = match.group(1), match.group(2)
        name = fields.get(name, name)
        if index is None or (name == "stop" and isinstance(self.stop, str)):
            return name
        return f"{name}[{index}]"
