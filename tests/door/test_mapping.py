"""OpenAI bodies to `epd.v1` and back, without a socket: validation naming the field, sampling
fields (contract 1.6) and choices' seeds, the chunk and usage objects, gRPC statuses to HTTP, the
router's media item index back to the client's field, transcription forms and segments."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from libs.contract.epd.v1 import generate_pb2, generation_pb2, media_pb2
from libs.contract.errors import (
    DeadlineExceeded,
    EpdError,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from libs.contract.grpc_status import ERROR_FIELD_METADATA_KEY
from libs.contract.reasons import STATUS_DETAILS_KEY, Reason, status_details
from libs.door.openai import chat, errors, responses, transcription
from libs.door.openai.errors import ApiError
from libs.door.openai.fields import parse

pytestmark = pytest.mark.unit


def _body(**fields: Any) -> chat.ChatCompletionRequest:
    raw = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    body: chat.ChatCompletionRequest = parse(chat.ChatCompletionRequest, raw)
    return body


def _refusal(raw: Any) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse(chat.ChatCompletionRequest, raw)
    return caught.value


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": []}, "tools"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0].image_url.url",
        ),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_refusals_name_the_field(raw: dict[str, Any], param: str) -> None:
    error = _refusal(raw)
    assert (error.status, error.param) == (400, param)


def test_a_body_that_is_not_an_object_is_400() -> None:
    assert _refusal([1, 2]).status == 400


def test_sampling_fields_and_choice_seeds() -> None:
    body = _body(
        temperature=0.7,
        top_p=0.9,
        top_k=-1,
        n=3,
        seed=41,
        stop="END",
        max_completion_tokens=20,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.1,
        min_tokens=2,
        ignore_eos=True,
        logprobs=True,
        top_logprobs=3,
    )
    requests = [chat.generate_request(body, {}, request_id="r", choice=i, default_temperature=1.0) for i in range(3)]
    assert [r.request_id for r in requests] == ["r-0", "r-1", "r-2"]
    assert [r.sampling.seed for r in requests] == [41, 42, 43]
    s = requests[0].sampling
    assert (s.temperature, s.top_k, s.max_tokens, list(s.stop)) == (pytest.approx(0.7), 0, 20, ["END"])
    assert s.top_p == pytest.approx(0.9) and s.repetition_penalty == pytest.approx(1.1)
    assert (s.presence_penalty, s.frequency_penalty, s.min_tokens, s.ignore_eos, s.logprobs) == (0.5, -0.25, 2, True, 3)


def test_defaults_follow_openai_and_leave_1_6_fields_unset() -> None:
    request = chat.generate_request(_body(), {}, request_id="r", choice=0, default_temperature=1.0)
    assert request.request_id == "r" and request.sampling.temperature == 1.0
    assert not request.sampling.HasField("seed") and not request.sampling.HasField("logprobs")
    assert request.sampling.ListFields() == [(request.sampling.DESCRIPTOR.fields_by_name["temperature"], 1.0)]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 5, "max_completion_tokens": 6}, "max_tokens"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({"stop": ["a", ""]}, "stop[1]"),
        ({"stop": ""}, "stop"),
        ({"max_completion_tokens": 5000}, "max_completion_tokens"),
    ],
)
def test_inconsistent_fields_are_refused(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as caught:
        chat.generate_request(_body(**fields), {}, request_id="r", choice=0, default_temperature=1.0)
    assert caught.value.param == param


def test_text_no_utf8_carries_is_refused_by_its_field() -> None:
    """Whatever reached the model (the body reader refuses it first, `libs/door/openai/body.py`),
    building the request refuses a lone surrogate naming the field, not with UnicodeEncodeError."""
    for content, param in (
        ("a\ud800", "messages[0].content"),
        ([{"type": "text", "text": "\udfff"}], "messages[0].content[0].text"),
    ):
        body = _body(messages=[{"role": "user", "content": content}])
        with pytest.raises(ApiError) as caught:
            chat.generate_request(body, {}, request_id="r", choice=0, default_temperature=1.0)
        assert (caught.value.status, caught.value.param) == (400, param)


def test_media_parts_keep_their_order_and_audio_becomes_a_data_url() -> None:
    body = _body(
        messages=[
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "look"},
                    {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
                    {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
                ],
            },
        ]
    )
    parts = chat.media_parts(body)
    assert [path for path, _ in parts] == ["messages[1].content[1]", "messages[1].content[2]"]
    assert chat.media_source(parts[1][1]) == (media_pb2.MODALITY_AUDIO, "data:audio/wav;base64,UklGRg==")
    assert [chat.source_field(p, part) for p, part in parts] == [
        "messages[1].content[1].image_url.url",
        "messages[1].content[2].input_audio.data",
    ]
    items = {p: media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=b"x", id=p) for p, _ in parts}
    wire = chat.messages_to_wire(body, items)
    assert [m.role for m in wire] == [1, 2]
    assert [p.WhichOneof("kind") for p in wire[1].parts] == ["text", "media", "media"]


def test_media_in_an_assistant_turn_is_refused() -> None:
    body = _body(messages=[{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(ApiError) as caught:
        chat.media_parts(body)
    assert caught.value.param == "messages[0].content[0]"


def _chunk(text: str, ids: list[int], finish: int = 0) -> generate_pb2.GenerateResponse:
    return generate_pb2.GenerateResponse(
        chunk=generation_pb2.TokenChunk(token_ids=ids, text=text, finish_reason=finish)
    )


def test_chunks_and_whole_completion() -> None:
    envelope = responses.Envelope("chatcmpl-1", "m", 7)
    first = envelope.chat_chunk(0, _chunk("He", [1]).chunk, first=True, logprobs=False)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "He"}
    assert first["choices"][0]["finish_reason"] is None
    last = envelope.chat_chunk(
        0, _chunk("", [2], generation_pb2.FINISH_REASON_LENGTH).chunk, first=False, logprobs=False
    )
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "length"
    a, b = responses.Choice(0), responses.Choice(1)
    for choice, text in ((a, "x"), (b, "yz")):
        choice.add(_chunk(text, [1]))
        end = _chunk("", [], generation_pb2.FINISH_REASON_STOP)
        end.usage.prompt_tokens, end.usage.completion_tokens = 30, len(text)
        choice.add(end)
    whole = envelope.chat_completion([a, b], logprobs=False)
    assert [c["message"]["content"] for c in whole["choices"]] == ["x", "yz"]
    assert whole["usage"] == {
        "prompt_tokens": 30,
        "completion_tokens": 3,
        "total_tokens": 33,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert envelope.usage_chunk("chat.completion.chunk", [a, b])["choices"] == []


def test_logprobs_entries() -> None:
    chunk = generation_pb2.TokenChunk(token_ids=[5], text="a")
    entry = chunk.logprobs.add()
    entry.chosen.token_id, entry.chosen.logprob, entry.chosen.token = 5, -0.5, "a"
    alt = entry.top.add()
    alt.token_id, alt.logprob, alt.token = 6, -1.5, "b"
    assert responses.chat_logprobs(chunk) == [
        {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": [{"token": "b", "logprob": -1.5, "bytes": [98]}]}
    ]


def _rpc_error(code: grpc.StatusCode, details: str, trailers: tuple[tuple[str, Any], ...] = ()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailers), details)


@pytest.mark.parametrize(
    ("code", "details", "status"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, "x", 400),
        (grpc.StatusCode.UNAUTHENTICATED, "x", 401),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", 429),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max (9 vs. 8)", 413),
        (grpc.StatusCode.UNAVAILABLE, "x", 503),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "x", 504),
        (grpc.StatusCode.INTERNAL, "x", 500),
    ],
)
def test_grpc_statuses_become_http_statuses(code: grpc.StatusCode, details: str, status: int) -> None:
    error = errors.from_rpc(_rpc_error(code, details))
    assert error.status == status
    assert ("Retry-After" in error.headers) == (status == 429)


def test_field_and_reason_travel_into_the_error() -> None:
    trailers = (
        (ERROR_FIELD_METADATA_KEY, "media item 1"),
        (STATUS_DETAILS_KEY, status_details(grpc.StatusCode.UNAVAILABLE, "draining", Reason.DRAINING)),
    )
    error = errors.from_rpc(_rpc_error(grpc.StatusCode.UNAVAILABLE, "draining", trailers))
    assert (error.status, error.code, error.param, error.headers) == (
        503,
        "draining",
        "epd.media item 1",
        {"Retry-After": "1"},
    )
    moved = errors.relocate(error, ["messages[0].content[0].image_url.url", "messages[0].content[2].video_url.url"])
    assert moved.param == "messages[0].content[2].video_url.url"
    assert errors.relocate(error, []).param == "epd.media item 1"


@pytest.mark.parametrize(
    "raised",
    [
        InvalidArgument("media item 1", "not an image"),
        Unavailable("draining", reason=Reason.DRAINING),
        ResourceExhausted("router is full", reason=Reason.OVERLOADED),
        ResourceExhausted("Received message larger than max (9 vs. 8)"),
        DeadlineExceeded("deadline passed while waiting for router"),
        FailedPrecondition("version mismatch"),
    ],
    ids=lambda e: type(e).__name__ + (f"-{e.reason.name}" if e.reason else ""),
)
def test_an_error_raised_in_the_doors_process_reads_as_its_status_over_grpc(raised: EpdError) -> None:
    """The router's door (`from_error`) answers a typed error as the process door answers the
    status the router's gRPC server sends for it (`from_rpc`): status, code, field, Retry-After."""
    trailers: list[tuple[str, str | bytes]] = []
    if isinstance(raised, InvalidArgument):
        trailers.append((ERROR_FIELD_METADATA_KEY, raised.field))
    if raised.reason is not None:
        trailers.append((STATUS_DETAILS_KEY, status_details(raised.code, raised.message, raised.reason)))
    assert errors.from_error(raised) == errors.from_rpc(_rpc_error(raised.code, raised.message, tuple(trailers)))


def test_transcription_form() -> None:
    form = transcription.parse_form(
        {"model": "w", "response_format": "verbose_json", "file": "f"}, b"RIFF", "audio/wav"
    )
    assert transcription.request_for(form, "r").sampling.timestamps
    for fields, param in (
        ({"model": "w", "language": "de"}, "language"),
        ({"model": "w", "response_format": "srt"}, "response_format"),
        ({"model": "w", "temperature": "0.4"}, "temperature"),
        ({"model": "w", "chunking_strategy": "auto"}, "chunking_strategy"),
        ({}, "model"),
    ):
        with pytest.raises(ApiError) as caught:
            transcription.parse_form(fields, b"RIFF", "audio/wav")
        assert caught.value.param == param


def test_segments_follow_the_timestamp_tokens_across_windows() -> None:
    begin = 1000  # <|0.00|>; token 1000 + k marks k * 0.02 s
    window_one = [begin, 1, 2, begin + 250, begin + 260, 3, begin + 1400]  # 0-5 s, 5.2-28 s
    window_two = [begin, 4, begin + 100, 5]  # counts from 28 s, where window one's last segment ended; a tail
    found = transcription.segments(window_one + window_two, begin, lambda ids: "".join(f"<{t}>" for t in ids))
    assert [(s.start_s, s.end_s, s.text) for s in found] == [
        (0.0, 5.0, "<1><2>"),
        (5.2, 28.0, "<3>"),
        (28.0, 30.0, "<4>"),
        (30.0, 30.0, "<5>"),
    ]
    assert found[0].tokens == (1, 2)
    assert transcription.segments([7, 8], begin, str)[0].start_s == 0.0  # no timestamps: one segment from 0
