"""`POST /v1/completions` bodies: a text prompt, sent as a raw prompt (`CHAT_ROLE_RAW`, contract
1.6: no chat template), one `GenerateRequest` per choice."""

from __future__ import annotations

import pydantic

from libs.contract.epd.v1 import chat_pb2, generate_pb2
from libs.door.openai.chat import StreamOptions, text_part
from libs.door.openai.errors import invalid
from libs.door.openai.sampling import SamplingFields


class CompletionRequest(SamplingFields):
    model: str
    prompt: str | list[str]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = pydantic.Field(default=16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = pydantic.Field(default=None, ge=0, le=20)
    echo: bool = False
    user: str | None = None
    # vLLM's extension: a scope for cached prefixes inside the caller's (libs/door/app.py, `tenant_salt`).
    cache_salt: str | None = pydantic.Field(default=None, max_length=256)

    def text(self) -> str:
        prompts = [self.prompt] if isinstance(self.prompt, str) else self.prompt
        if len(prompts) != 1:
            raise invalid("prompt", "one prompt per request (send a list of one, or a string)")
        if not prompts[0]:
            raise invalid("prompt", "must not be empty")
        if self.echo:
            raise invalid("echo", "echoing the prompt is not supported")
        return prompts[0]


def generate_request(
    body: CompletionRequest, *, request_id: str, choice: int, default_temperature: float, cache_salt: str = ""
) -> generate_pb2.GenerateRequest:
    prompt = text_part(body.text(), "prompt" if isinstance(body.prompt, str) else "prompt[0]")
    message = chat_pb2.ChatMessage(role=chat_pb2.CHAT_ROLE_RAW, parts=[prompt])
    sampling = body.sampling(
        max_tokens=body.max_tokens,
        logprobs=body.logprobs,
        choice=choice,
        default_temperature=default_temperature,
        fields={},
    )
    suffix = f"-{choice}" if body.n > 1 else ""
    return generate_pb2.GenerateRequest(
        request_id=f"{request_id}{suffix}", messages=[message], sampling=sampling, cache_salt=cache_salt
    )
