"""OpenAI response objects from the `Generate` stream: whole completions and SSE chunks."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from libs.contract.epd.v1 import generate_pb2, generation_pb2

_FINISH = {
    generation_pb2.FINISH_REASON_STOP: "stop",
    generation_pb2.FINISH_REASON_STOP_SEQUENCE: "stop",
    generation_pb2.FINISH_REASON_LENGTH: "length",
}
DONE = "data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


def finish_reason(chunk: generation_pb2.TokenChunk) -> str | None:
    return _FINISH.get(chunk.finish_reason) if chunk.finish_reason else None


def _logprob(entry: Any) -> dict[str, Any]:
    return {"token": entry.token, "logprob": entry.logprob, "bytes": list(entry.token.encode())}


def chat_logprobs(chunk: generation_pb2.TokenChunk) -> list[dict[str, Any]]:
    """OpenAI chat's `logprobs.content` entries of one chunk (one per token)."""
    return [{**_logprob(t.chosen), "top_logprobs": [_logprob(alt) for alt in t.top]} for t in chunk.logprobs]


def completion_logprobs(chunks: Iterable[generation_pb2.TokenChunk]) -> dict[str, Any]:
    """The legacy completions `logprobs` object (tokens, token_logprobs, top_logprobs, text_offset)."""
    tokens, values, tops, offsets, offset = [], [], [], [], 0
    for chunk in chunks:
        for entry in chunk.logprobs:
            tokens.append(entry.chosen.token)
            values.append(entry.chosen.logprob)
            tops.append({alt.token: alt.logprob for alt in entry.top})
            offsets.append(offset)
            offset += len(entry.chosen.token)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


@dataclass
class Choice:
    """One choice's stream, collected."""

    index: int
    text: str = ""
    finish: str | None = None
    chunks: list[generation_pb2.TokenChunk] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the engine reused from a cached prefix

    def add(self, response: generate_pb2.GenerateResponse) -> None:
        self.chunks.append(response.chunk)
        self.text += response.chunk.text
        self.finish = finish_reason(response.chunk) or self.finish
        if response.HasField("usage"):
            self.prompt_tokens = response.usage.prompt_tokens
            self.completion_tokens = response.usage.completion_tokens
            self.cached_tokens = response.usage.cached_prompt_tokens


def usage(choices: Iterable[Choice]) -> dict[str, Any]:
    """Prompt tokens once (every choice has the same prompt, media placeholders included),
    completion tokens summed over the choices; the prompt tokens a cached prefix held, as OpenAI
    reports them (`prompt_tokens_details.cached_tokens`)."""
    listed = list(choices)
    prompt = max((c.prompt_tokens for c in listed), default=0)
    completion = sum(c.completion_tokens for c in listed)
    cached = min((c.cached_tokens for c in listed), default=0)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


@dataclass(frozen=True)
class Envelope:
    """What every object of one response shares."""

    id: str
    model: str
    created: int

    def chat_completion(self, choices: list[Choice], logprobs: bool) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": {"content": [e for ch in c.chunks for e in chat_logprobs(ch)]} if logprobs else None,
                    "finish_reason": c.finish,
                }
                for c in choices
            ],
            "usage": usage(choices),
        }

    def chat_chunk(
        self, index: int, chunk: generation_pb2.TokenChunk, *, first: bool, logprobs: bool
    ) -> dict[str, Any]:
        """One SSE chunk; the first of a choice carries the role with its first text (no
        role-only chunk: a client timing the first token sees the first token)."""
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if chunk.text or first:
            delta["content"] = chunk.text
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": index,
                    "delta": delta,
                    "logprobs": {"content": chat_logprobs(chunk)} if logprobs else None,
                    "finish_reason": finish_reason(chunk),
                }
            ],
        }

    def usage_chunk(self, kind: str, choices: Iterable[Choice]) -> dict[str, Any]:
        """The last chunk of a stream with `stream_options.include_usage`: no choices, the usage."""
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage(choices),
        }

    def text_completion(self, choices: list[Choice], logprobs: bool) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": c.index,
                    "text": c.text,
                    "logprobs": completion_logprobs(c.chunks) if logprobs else None,
                    "finish_reason": c.finish,
                }
                for c in choices
            ],
            "usage": usage(choices),
        }

    def text_chunk(self, index: int, chunk: generation_pb2.TokenChunk, *, logprobs: bool) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": index,
                    "text": chunk.text,
                    "logprobs": completion_logprobs([chunk]) if logprobs else None,
                    "finish_reason": finish_reason(chunk),
                }
            ],
        }
