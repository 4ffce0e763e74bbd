"""A property-based fuzzer over the door's request bodies: chat and text completions whose every
field may hold a plausible value or any other JSON (huge integers, floats past float32, booleans
where numbers belong, strings with lone surrogates, nested containers), media parts with data URLs
whose bytes and claims disagree, bodies nested thousands deep, truncated or under another media
type. Through the real application (a fake router behind it that checks requests as the router
does): no answer may be a 5xx and no exception may escape the app; every refusal is OpenAI's error
object.

`max_examples` is modest for CI; `EPD_FUZZ_EXAMPLES=10000` (the environment) runs a larger search
(docs/openai-door.md, "Errors").
"""

from __future__ import annotations

import base64
import collections
import json
import os
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libs.fetch import FetchLimits
from tests.support.door_router import MODEL, data_url, door, png_bytes
from tests.support.media_server import FakeDns

pytestmark = pytest.mark.unit

EXAMPLES = int(os.environ.get("EPD_FUZZ_EXAMPLES", "300"))

# Integers at and past every width the contract's fields have, and past what JSON parsers take.
_EDGES = [0, 1, -1, 16, 4096, 4097, 2**31 - 1, 2**31, -(2**31) - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 10**30]
_TEXT = st.text(st.characters(exclude_categories=()), max_size=12)  # lone surrogates included
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from(_EDGES),
    st.integers(min_value=-(2**200), max_value=2**200),
    st.floats(),  # NaN and infinities too: json.dumps writes them, the door must refuse them
    st.sampled_from([0.5, 1.5, 3.5e38, 1e39, -1e300, 5e-324]),
    _TEXT,
)
_ANY = st.recursive(
    _SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3), max_leaves=8
)
_NUMBER = st.one_of(st.sampled_from(_EDGES), st.integers(-10, 100), st.floats(-3, 3), _ANY)
_PNG = png_bytes()
_BYTES = st.sampled_from(
    [_PNG, b"RIFF\0\0\0\0WAVEfmt ", b"\0\0\0\x18ftypmp42", b"OggS\0", b"plain text", b"\xff\xd8\xff"]
)
_MIMES = st.sampled_from(
    ["image/png", "image/jpeg", "audio/wav", "video/mp4", "text/plain", "application/octet-stream", ""]
)
_URL = st.one_of(
    st.builds(lambda mime, data: data_url(mime, data), _MIMES, _BYTES),
    st.sampled_from(
        [
            "http://127.0.0.1/a.png",
            "http://[::1]/a.png",
            "http://10.0.0.1/a.png",
            "https://media.example/a.png",  # resolves (the fake DNS) to a private address: refused
            "ftp://x/a.png",
            "data:image/png;base64,%%%",
            "data:image/png,raw",
            "data:;base64,AAAA",
            "",
        ]
    ),
    _ANY,
)
_PART = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": _TEXT | _ANY}),
    st.fixed_dictionaries(
        {"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": _URL}) | _ANY},
        optional={"detail": st.sampled_from(["auto", "low", "high"]) | _ANY},
    ),
    st.fixed_dictionaries({"type": st.just("video_url"), "video_url": st.fixed_dictionaries({"url": _URL})}),
    st.fixed_dictionaries({"type": st.just("audio_url"), "audio_url": st.fixed_dictionaries({"url": _URL})}),
    st.fixed_dictionaries(
        {
            "type": st.just("input_audio"),
            "input_audio": st.fixed_dictionaries(
                {
                    "data": st.builds(lambda b: base64.b64encode(b).decode(), _BYTES) | _ANY,
                    "format": st.sampled_from(["wav", "mp3", "flac", "ogg", "aiff"]) | _ANY,
                }
            ),
        }
    ),
    st.dictionaries(_TEXT, _ANY, max_size=3),
)
_VALID_TEXT = st.text(max_size=12)
_HOSTILE_MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]) | _ANY,
        "content": _TEXT | st.lists(_PART, max_size=3) | _ANY,
    },
    optional={"name": _TEXT | _ANY},
)
_MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "developer", "user", "assistant"]),
        "content": _VALID_TEXT.filter(bool) | st.lists(_PART, min_size=1, max_size=3),
    },
    optional={"name": _VALID_TEXT},
)
# Each field's plausible values; `requests` then gives a few of them a hostile one.
_SAMPLING = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 100),
    "n": st.integers(1, 3),
    "max_tokens": st.integers(1, 64),
    "seed": st.integers(0, 2**63 - 1),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "min_tokens": st.integers(0, 1),
    "stop": st.text(min_size=1, max_size=4) | st.lists(st.text(min_size=1, max_size=4), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 1000), max_size=3),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "user": _VALID_TEXT,
}
CHAT = st.fixed_dictionaries(
    {"model": st.sampled_from([MODEL, "/models/tiny"]), "messages": st.lists(_MESSAGE, min_size=1, max_size=3)},
    optional={
        **_SAMPLING,
        "max_completion_tokens": st.integers(1, 64),
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(0, 20),
    },
)
COMPLETION = st.fixed_dictionaries(
    {"model": st.sampled_from([MODEL, "/models/tiny"]), "prompt": _VALID_TEXT.filter(bool)},
    optional={**_SAMPLING, "logprobs": st.integers(0, 20)},
)
_CHAT_FIELDS = ["model", "messages", *_SAMPLING, "max_completion_tokens", "logprobs", "top_logprobs", "metadata"]
_COMPLETION_FIELDS = ["model", "prompt", *_SAMPLING, "logprobs", "echo", "metadata"]
_HOSTILE = {
    "messages": st.lists(_HOSTILE_MESSAGE, min_size=1, max_size=3) | _ANY,
    "prompt": _TEXT | st.lists(_TEXT, max_size=2) | _ANY,
    "model": st.just("other") | _TEXT | _ANY,
    "stop_token_ids": st.lists(_NUMBER, max_size=4) | _ANY,
}


def _nested(depth: int, body: str) -> str:
    return '{"model": "tiny", "x": ' + "[" * depth + body + "]" * depth + "}"


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, bytes, str]:
    """(route, raw body, content type)."""
    route, body, fields = draw(
        st.sampled_from(
            [("/v1/chat/completions", CHAT, _CHAT_FIELDS), ("/v1/completions", COMPLETION, _COMPLETION_FIELDS)]
        )
    )
    value: dict[str, Any] = dict(draw(body))  # type: ignore[call-overload]  # a fixed_dictionaries strategy
    for name in draw(st.lists(st.sampled_from(fields), max_size=3, unique=True)):  # none: a valid request
        value[name] = draw(_HOSTILE.get(name, _NUMBER))
    text = json.dumps(value, ensure_ascii=draw(st.booleans()))  # both escape forms of every character
    raw = text.encode("utf-8", "surrogatepass")  # a lone surrogate unescaped: bytes no UTF-8 decoder takes
    shape = draw(st.sampled_from(["as is"] * 8 + ["truncated", "nested", "garbage"]))
    if shape == "truncated":
        raw = raw[: draw(st.integers(0, max(len(raw) - 1, 0)))]
    elif shape == "nested":
        raw = _nested(draw(st.integers(1, 5000)), text).encode("utf-8", "surrogatepass")
    elif shape == "garbage":
        raw = draw(st.binary(max_size=64))
    content_type = draw(st.sampled_from(["application/json"] * 6 + ["application/json; charset=utf-8", "text/plain"]))
    return route, raw, content_type


def test_no_request_body_gets_a_5xx_or_escapes_the_app() -> None:
    d = door(fetch=FetchLimits(max_bytes=1 << 20, timeout_s=2), dns=FakeDns({"media.example": ["10.0.0.1"]}))
    statuses: collections.Counter[int] = collections.Counter()
    # One event loop for every request (the fetcher's session belongs to one); an exception that
    # escapes the app fails the test.
    with d.client(raise_server_exceptions=True) as client:

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
        )
        @given(requests())
        def one(request: tuple[str, bytes, str]) -> None:
            route, raw, content_type = request
            reply = client.post(route, content=raw, headers={"content-type": content_type})
            statuses[reply.status_code] += 1
            assert reply.status_code < 500, (reply.status_code, reply.text, raw[:300])
            if reply.status_code >= 400:
                error = reply.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}, error
                assert len(reply.content) < 2048  # a short prefix of the client's input at most

        started = time.perf_counter()
        try:
            one()
        finally:
            took = time.perf_counter() - started
            client.portal.call(d.fetch.close)  # type: ignore[union-attr]  # set while the client is open
    print(f"door fuzz: {sum(statuses.values())} requests in {took:.1f} s, statuses {dict(sorted(statuses.items()))}")
    # The search reaches both sides: requests served and requests refused.
    assert statuses[200] > 0 and sum(n for s, n in statuses.items() if 400 <= s < 500) > 0
    counted: collections.Counter[int] = collections.Counter()
    for (_, status), n in d.counts().items():
        counted[int(status)] += int(n)
    assert counted == statuses  # every answer counted, by its status
