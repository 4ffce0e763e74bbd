"""`POST /v1/chat/completions` bodies: the models, and the `GenerateRequest` each choice is."""

from __future__ import annotations

from typing import Annotated, Literal

import pydantic

from libs.contract.bounds import checked
from libs.contract.epd.v1 import chat_pb2, generate_pb2, media_pb2
from libs.contract.errors import InvalidArgument
from libs.door.openai.errors import invalid
from libs.door.openai.fields import Body
from libs.door.openai.sampling import SamplingFields


class ImageUrl(Body):
    url: str
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the processor's own resize applies


class VideoUrl(Body):
    url: str


class InputAudio(Body):
    data: str  # base64
    format: Literal["wav", "mp3", "flac", "ogg"]


class AudioUrl(Body):
    url: str


class TextPart(Body):
    type: Literal["text"]
    text: str


class ImagePart(Body):
    type: Literal["image_url"]
    image_url: ImageUrl


class VideoPart(Body):
    type: Literal["video_url"]
    video_url: VideoUrl


class InputAudioPart(Body):
    type: Literal["input_audio"]
    input_audio: InputAudio


class AudioUrlPart(Body):
    type: Literal["audio_url"]  # vLLM's extension, beside OpenAI's input_audio
    audio_url: AudioUrl


Part = Annotated[TextPart | ImagePart | VideoPart | InputAudioPart | AudioUrlPart, pydantic.Field(discriminator="type")]
MediaPart = ImagePart | VideoPart | InputAudioPart | AudioUrlPart


class Message(Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[Part]
    name: str | None = None  # accepted, as OpenAI does; the chat template has no place for it


class StreamOptions(Body):
    include_usage: bool = False


class ChatCompletionRequest(SamplingFields):
    model: str
    messages: list[Message] = pydantic.Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_completion_tokens: int | None = pydantic.Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = pydantic.Field(default=None, ge=0, le=20)
    user: str | None = None  # accepted (OpenAI: the end user, for abuse monitoring); not used
    # vLLM's extension: a scope for cached prefixes inside the caller's (libs/door/app.py, `tenant_salt`).
    cache_salt: str | None = pydantic.Field(default=None, max_length=256)

    def token_budget(self) -> int | None:
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise invalid("max_tokens", "differs from max_completion_tokens; send one of them")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprob_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs", "needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None


_ROLES = {
    "system": chat_pb2.CHAT_ROLE_SYSTEM,
    "developer": chat_pb2.CHAT_ROLE_SYSTEM,
    "user": chat_pb2.CHAT_ROLE_USER,
    "assistant": chat_pb2.CHAT_ROLE_ASSISTANT,
}
_AUDIO_MIME = {"wav": "audio/wav", "mp3": "audio/mpeg", "flac": "audio/flac", "ogg": "audio/ogg"}


def media_source(part: MediaPart) -> tuple[media_pb2.Modality.ValueType, str]:
    """The modality and URL (http(s) or data) of a media part; input_audio becomes a data URL so
    that one set of limits decodes every inline payload."""
    if isinstance(part, ImagePart):
        return media_pb2.MODALITY_IMAGE, part.image_url.url
    if isinstance(part, VideoPart):
        return media_pb2.MODALITY_VIDEO, part.video_url.url
    if isinstance(part, AudioUrlPart):
        return media_pb2.MODALITY_AUDIO, part.audio_url.url
    return media_pb2.MODALITY_AUDIO, f"data:{_AUDIO_MIME[part.input_audio.format]};base64,{part.input_audio.data}"


def source_field(path: str, part: MediaPart) -> str:
    """The field holding a media part's bytes or URL: `messages[0].content[1].image_url.url`."""
    return f"{path}.{part.type}." + ("data" if isinstance(part, InputAudioPart) else "url")


def media_parts(body: ChatCompletionRequest) -> list[tuple[str, MediaPart]]:
    """Every media part with its field path (`messages[0].content[1]`), in prompt order."""
    found: list[tuple[str, MediaPart]] = []
    for i, message in enumerate(body.messages):
        if isinstance(message.content, str):
            continue
        for j, part in enumerate(message.content):
            if not isinstance(part, TextPart):
                if message.role != "user":
                    raise invalid(
                        f"messages[{i}].content[{j}]", f"media parts belong in user messages, not {message.role}"
                    )
                found.append((f"messages[{i}].content[{j}]", part))
    return found


def text_part(text: str, field: str) -> chat_pb2.ContentPart:
    """A text part, refused (400 naming `field`) if its text is no Unicode UTF-8 can carry."""
    try:
        return checked(chat_pb2.ContentPart, "part", text=text)
    except InvalidArgument as exc:
        raise invalid(field, exc.problem) from None


def messages_to_wire(body: ChatCompletionRequest, media: dict[str, media_pb2.MediaItem]) -> list[chat_pb2.ChatMessage]:
    """The conversation with each media part replaced by its fetched item (keyed by field path)."""
    out = []
    for i, message in enumerate(body.messages):
        if isinstance(message.content, str):
            parts = [text_part(message.content, f"messages[{i}].content")]
        else:
            parts = []
            for j, part in enumerate(message.content):
                if isinstance(part, TextPart):
                    parts.append(text_part(part.text, f"messages[{i}].content[{j}].text"))
                else:
                    parts.append(chat_pb2.ContentPart(media=media[f"messages[{i}].content[{j}]"]))
        if not parts:
            raise invalid(f"messages[{i}].content", "at least one content part")
        out.append(chat_pb2.ChatMessage(role=_ROLES[message.role], parts=parts))
    return out


def generate_request(
    body: ChatCompletionRequest,
    media: dict[str, media_pb2.MediaItem],
    *,
    request_id: str,
    choice: int,
    default_temperature: float,
    cache_salt: str = "",
) -> generate_pb2.GenerateRequest:
    """Choice `choice` (of `n`) of the request: choice i > 0 samples with seed + i; `cache_salt`:
    its scope for cached prefixes."""
    budget_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    sampling = body.sampling(
        max_tokens=body.token_budget(),
        logprobs=body.logprob_count(),
        choice=choice,
        default_temperature=default_temperature,
        fields={"max_tokens": budget_field, "logprobs": "top_logprobs"},
    )
    suffix = f"-{choice}" if body.n > 1 else ""
    return generate_pb2.GenerateRequest(
        request_id=f"{request_id}{suffix}",
        messages=messages_to_wire(body, media),
        sampling=sampling,
        cache_salt=cache_salt,
    )
