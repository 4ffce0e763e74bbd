"""The requests issue 65 found answered with a 500, or served though they should not be, through
the door's real application (a fake router behind it): each is now a 4xx in OpenAI's error shape
naming the field, counted in /metrics, and the door answers a normal request after it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from libs.door.app import SpeechVocab
from tests.support.door_router import CHAT, COMPLETION, MODEL, Door, data_url, door, png_bytes

pytestmark = pytest.mark.unit

JSON = {"content-type": "application/json"}


def _deep(levels: int, leaf: str = "1") -> str:
    return '{"a":' * levels + leaf + "}" * levels


def _chat(**fields: Any) -> str:
    return json.dumps({**CHAT, **fields})


def _image(url: str) -> str:
    return _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}])


# (case, route, body, status, param): the eleven 500s first, then what it found served.
CASES: list[tuple[str, str, str, int, str | None]] = [
    ("nested 10,000 deep", "/v1/chat/completions", _deep(10_000), 400, "body"),
    (
        "metadata nested 10,000 deep",
        "/v1/chat/completions",
        _chat()[:-1] + f', "metadata": {_deep(10_000)}}}',
        400,
        "body",
    ),
    (
        "content in 1,000 arrays",
        "/v1/chat/completions",
        '{"model": "tiny", "messages": [{"role": "user", "content": ' + "[" * 1000 + '"x"' + "]" * 1000 + "}]}",
        400,
        "body",
    ),
    (
        "lone surrogates in text",
        "/v1/chat/completions",
        _chat(messages=[{"role": "user", "content": "hi \ud800 there \udfff"}]),
        400,
        "messages[0].content",
    ),
    ("max_tokens 10**12", "/v1/chat/completions", _chat(max_tokens=10**12), 400, "max_tokens"),
    ("max_tokens 10**12 streamed", "/v1/chat/completions", _chat(max_tokens=10**12, stream=True), 400, "max_tokens"),
    (
        "max_completion_tokens 10**30",
        "/v1/chat/completions",
        _chat(max_completion_tokens=10**30),
        400,
        "max_completion_tokens",
    ),
    ("top_k 10**12", "/v1/chat/completions", _chat(top_k=10**12), 400, "top_k"),
    ("min_tokens 10**12", "/v1/chat/completions", _chat(min_tokens=10**12), 400, "min_tokens"),
    ("stop_token_ids [2**40]", "/v1/chat/completions", _chat(stop_token_ids=[1 << 40]), 400, "stop_token_ids[0]"),
    (
        "completions max_tokens 10**12",
        "/v1/completions",
        json.dumps({**COMPLETION, "max_tokens": 10**12}),
        400,
        "max_tokens",
    ),
    # Beyond the eleven: the same classes elsewhere in the schema.
    (
        "lone surrogate in a text part",
        "/v1/chat/completions",
        _chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a\udc00"}]}]),
        400,
        "messages[0].content[0].text",
    ),
    ("lone surrogate in a prompt", "/v1/completions", json.dumps({**COMPLETION, "prompt": "\ud83d"}), 400, "prompt"),
    ("lone surrogate in model", "/v1/chat/completions", _chat(model="m\ud800"), 400, "model"),
    ("lone surrogate in a key", "/v1/chat/completions", '{"model": "tiny", "\\ud800": 1}', 400, "\\ud800"),
    (
        "a 5,000-digit integer",  # past what the parser takes as a number: the body is refused
        "/v1/chat/completions",
        _chat()[:-1] + ', "max_tokens": ' + "9" * 5000 + "}",
        400,
        "body",
    ),
    ("a 300-digit integer", "/v1/chat/completions", _chat(max_tokens=10**300), 400, "max_tokens"),
    ("max_tokens past the model's limit", "/v1/chat/completions", _chat(max_tokens=(1 << 31) - 1), 400, "max_tokens"),
    ("stop_token_ids negative", "/v1/chat/completions", _chat(stop_token_ids=[-(1 << 40)]), 400, "stop_token_ids[0]"),
    (
        "repetition_penalty past float32",
        "/v1/chat/completions",
        _chat(repetition_penalty=1e300),
        400,
        "repetition_penalty",
    ),
    ("NaN (not JSON)", "/v1/chat/completions", _chat()[:-1] + ', "temperature": NaN}', 400, "body"),
    ("a surrogate encoded in the bytes (CESU-8)", "/v1/chat/completions", '{"model": "\udcff"}', 400, "model"),
    # Strict types: no coercion.
    ("stream 'yes'", "/v1/chat/completions", _chat(stream="yes"), 400, "stream"),
    ("temperature '0.5'", "/v1/chat/completions", _chat(temperature="0.5"), 400, "temperature"),
    ("max_tokens true", "/v1/chat/completions", _chat(max_tokens=True), 400, "max_tokens"),
    ("n 1.0", "/v1/chat/completions", _chat(n=1.0), 400, "n"),
    ("ignore_eos 1", "/v1/completions", json.dumps({**COMPLETION, "ignore_eos": 1}), 400, "ignore_eos"),
    ("seed '7'", "/v1/completions", json.dumps({**COMPLETION, "seed": "7"}), 400, "seed"),
    (
        "include_usage 'true'",
        "/v1/chat/completions",
        _chat(stream=True, stream_options={"include_usage": "true"}),
        400,
        "stream_options.include_usage",
    ),
    # A data URL's bytes against its claim and its part's kind.
    (
        "a PNG under data:text/plain",
        "/v1/chat/completions",
        _image(data_url("text/plain", png_bytes())),
        400,
        "messages[0].content[0].image_url.url",
    ),
    (
        "a PNG under data:audio/wav in an image part",
        "/v1/chat/completions",
        _image(data_url("audio/wav", png_bytes())),
        400,
        "messages[0].content[0].image_url.url",
    ),
    (
        "a PNG under data:audio/wav in an audio part",
        "/v1/chat/completions",
        _chat(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "audio_url", "audio_url": {"url": data_url("audio/wav", png_bytes())}}],
                }
            ]
        ),
        400,
        "messages[0].content[0].audio_url.url",
    ),
    (
        "a PNG as input_audio",
        "/v1/chat/completions",
        _chat(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "input_audio",
                            "input_audio": {"data": data_url("x/y", png_bytes())[15:], "format": "wav"},
                        }
                    ],
                }
            ]
        ),
        400,
        "messages[0].content[0].input_audio.data",
    ),
]


def _post(d: Door, route: str, body: str, headers: dict[str, str] = JSON) -> Any:
    raw = body.encode("utf-8", "surrogatepass")
    return d.client().post(route, content=raw, headers=headers)


@pytest.mark.parametrize(("case", "route", "body", "status", "param"), CASES, ids=[c[0] for c in CASES])
def test_a_hostile_body_is_refused_naming_its_field(
    case: str, route: str, body: str, status: int, param: str | None
) -> None:
    d = door()
    reply = _post(d, route, body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error
    assert len(reply.content) < 1024  # never the client's input echoed back
    assert d.count(route, status) == 1
    assert d.router.seen == []  # refused before any call
    again = d.client().post(route, json=CHAT if route == "/v1/chat/completions" else COMPLETION)
    assert again.status_code == 200, again.text


def test_the_widest_values_the_contract_and_the_model_take_are_served() -> None:
    """The bounds refuse only what does not fit: the limits themselves pass."""
    d = door()
    fields = {"max_tokens": 4096, "min_tokens": 4096, "top_k": (1 << 31) - 1, "stop_token_ids": [(1 << 31) - 1]}
    reply = d.client().post("/v1/chat/completions", json={**CHAT, **fields, "seed": (1 << 63) - 1, "n": 2})
    assert reply.status_code == 200, reply.text
    sampling = d.router.seen[0].sampling
    assert (sampling.max_tokens, sampling.min_tokens, sampling.top_k) == (4096, 4096, (1 << 31) - 1)
    assert [r.sampling.seed for r in d.router.seen] == [(1 << 63) - 1, 0]  # seed + choice wraps


@pytest.mark.parametrize(
    ("content_type", "status"),
    [
        ("application/json", 200),
        ("application/json; charset=utf-8", 200),
        ('Application/JSON;charset="UTF-8"', 200),
        ("text/plain", 415),
        ("application/x-www-form-urlencoded", 415),
        ("multipart/form-data; boundary=x", 415),
        ("application/json; charset=latin-1", 415),
        ("application/jsonx", 415),
        (None, 415),
    ],
)
def test_a_body_must_be_declared_json(content_type: str | None, status: int) -> None:
    d = door()
    headers = {} if content_type is None else {"content-type": content_type}
    for route, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        reply = d.client().post(route, content=json.dumps(body).encode(), headers=headers)
        assert reply.status_code == status, reply.text
        if status == 415:
            assert reply.json()["error"]["code"] == "unsupported_media_type"
            assert d.count(route, 415) == 1
    assert len(d.router.seen) == (2 if status == 200 else 0)


def test_an_error_quotes_only_a_prefix_of_the_clients_input() -> None:
    d = door(max_body_bytes=8 << 20)
    huge = "m" * (2 << 20)
    wrong_model = d.client().post("/v1/chat/completions", json={**CHAT, "model": huge})
    unknown_key = d.client().post("/v1/chat/completions", json={**CHAT, huge: 1})
    path = d.client().post("/v1/" + "p" * 60_000, json=CHAT)
    assert (wrong_model.status_code, unknown_key.status_code, path.status_code) == (404, 400, 404)
    for reply, letter in ((wrong_model, "m"), (unknown_key, "m"), (path, "p")):
        assert len(reply.content) < 600, len(reply.content)
        assert letter * 32 in reply.text and "..." in reply.text  # enough to recognise it, then an ellipsis
        assert letter * 129 not in reply.text


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("POST", "/v1/chat/completions/", 404),
        ("POST", "/v1", 404),
        ("GET", "/v1", 404),
        ("POST", "/", 404),
        ("POST", "/v1/chat/completion", 404),
        ("GET", "/v1/chat/completions", 405),
        ("POST", "/v1/models", 405),
    ],
)
def test_an_unknown_route_is_answered_in_openais_shape(method: str, path: str, status: int) -> None:
    d = door()
    reply = d.client().request(method, path, json=CHAT)
    assert reply.status_code == status
    error = reply.json()["error"]
    assert error["type"] in ("not_found_error", "invalid_request_error") and error["code"] in (
        "unknown_url",
        "method_not_allowed",
    )
    assert path in error["message"]
    route = path if status == 405 else "unmatched"
    assert d.count(route, status) == 1  # a path of the client's own is never a label
    assert d.router.seen == []


def test_media_of_the_right_kind_travels_as_its_bytes_say() -> None:
    """Within a kind the bytes decide the type passed on; a generic claim is no contradiction."""
    d = door()
    for claim in ("image/jpeg", "application/octet-stream", "image/png"):
        reply = d.client().post("/v1/chat/completions", content=_image(data_url(claim, png_bytes())), headers=JSON)
        assert reply.status_code == 200, reply.text
    assert [r.messages[0].parts[0].media.mime_type for r in d.router.seen] == ["image/png"] * 3


def test_a_transcription_must_be_a_multipart_form() -> None:
    d = door(speech=SpeechVocab(timestamp_begin=1000, decode=lambda ids: ""))
    route = "/v1/audio/transcriptions"
    as_json = d.client().post(route, json={"model": MODEL})
    assert as_json.status_code == 415 and as_json.json()["error"]["code"] == "unsupported_media_type"
    wav = b"RIFF\x24\0\0\0WAVEfmt " + b"\0" * 24
    form = d.client().post(route, data={"model": MODEL}, files={"file": ("a.wav", wav, "audio/wav")})
    assert form.status_code == 200, form.text
    assert (d.count(route, 415), d.count(route, 200)) == (1, 1)


def test_the_valid_forms_of_text_pass() -> None:
    """What the refusals must not catch: a surrogate pair escaped in JSON is one character."""
    d = door()
    for text in ("\\ud83d\\ude00 as a pair", "\\u00e9t\\u00e9", "plain"):  # JSON escapes
        raw = ('{"model": "tiny", "messages": [{"role": "user", "content": "' + text + '"}]}').encode()
        reply = d.client().post("/v1/chat/completions", content=raw, headers=JSON)
        assert reply.status_code == 200, reply.text
    assert d.router.seen[0].messages[0].parts[0].text == "\U0001f600 as a pair"


@pytest.mark.parametrize("raw", [b'{"model": "\xff"}', b"\xfe\xff\x00{", '{"model": "tiny"}'.encode("utf-16")])
def test_a_body_that_is_not_utf8_is_400(raw: bytes) -> None:
    d = door()
    reply = d.client().post("/v1/chat/completions", content=raw, headers=JSON)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "body"
