"""The OpenAI door in front of a real E/P/D stack, as its own process and served by the router
(`--openai-port`, every test against both), called with the real `openai` client: chat with
media by data URL and by http URL from a local server, streaming and not, the same text as the gRPC
path for the same request, errors as OpenAI error objects, a client that disconnects mid-stream
(the door's span and metrics show it, every pool ends empty), and one trace from HTTP to decode."""

from __future__ import annotations

import asyncio
import base64
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from libs.contract.epd.v1 import chat_pb2, generate_pb2, sampling_pb2
from libs.launch.stack import Stack
from libs.telemetry.spans import OtlpReceiver
from tests.support.golden import request_for
from tests.support.openai_door import (
    disconnect_mid_stream,
    openai_messages,
    router_with_door,
    running_door,
    traceparent,
)
from tests.support.stacks import MIXES, run_requests, wait_pools_empty
from tests.support.tracing import trace_spans, tracing_env

pytestmark = pytest.mark.stack

MODEL = "qwen2_5_omni-tiny"


@pytest.fixture(scope="module")
def stack(stacks: Callable[[str], Stack]) -> Stack:
    return stacks("e/p/d")


@pytest.fixture(scope="module", params=["process", "router"])
def door(
    request: pytest.FixtureRequest,
    stack: Stack,
    model_path: Path,
    receiver: OtlpReceiver,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[str]:
    """The door as its own process in front of the session's E/P/D router, or served by a second
    router over the same backends (`--openai-port`); yields its base URL."""
    log_dir = tmp_path_factory.mktemp("door")
    if request.param == "process":
        with running_door(
            stack.address, model_path, log_dir, "--fetch-allow-private", env=tracing_env(receiver)
        ) as address:
            yield f"http://{address}/v1"
        return
    with router_with_door(stack, model_path, log_dir, "--fetch-allow-private", env=tracing_env(receiver)) as address:
        yield f"http://{address}/v1"


@pytest.fixture(scope="module")
def client(door: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=door, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def media_url() -> Iterator[Callable[[str, bytes, str], str]]:
    """Serve bytes at http://127.0.0.1:PORT/<name> from a thread's own loop; returns (name, data, mime) -> URL."""
    from aiohttp import web

    files: dict[str, tuple[bytes, str]] = {}
    hits: dict[str, int] = {}
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict[str, Any] = {}

    async def handle(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        hits[name] = hits.get(name, 0) + 1
        data, mime = files[name]
        return web.Response(body=data, content_type=mime)

    async def start() -> None:
        app = web.Application()
        app.router.add_get("/{name}", handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        holder["runner"], holder["port"] = runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        ready.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(start()), loop.run_forever()), daemon=True)
    thread.start()
    ready.wait(10)

    def put(name: str, data: bytes, mime: str) -> str:
        files[name] = (data, mime)
        return f"http://127.0.0.1:{holder['port']}/{name}"

    put.hits = hits  # type: ignore[attr-defined]
    yield put
    asyncio.run_coroutine_threadsafe(holder["runner"].cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mix_name", sorted(MIXES))
def test_chat_matches_the_grpc_path(client: openai.OpenAI, stack: Stack, mix_name: str) -> None:
    """The same request through the door and over gRPC: the same text, the same token counts (the
    prompt's include the media placeholders)."""
    request = request_for(MIXES[mix_name], max_tokens=8)
    direct = run_requests(stack.address, [request])[0]
    reply = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=8, messages=openai_messages(request))
    assert reply.choices[0].message.content == direct.text
    assert (
        reply.choices[0].finish_reason
        == {"FINISH_REASON_STOP": "stop", "FINISH_REASON_LENGTH": "length"}[direct.finish_reason]
    )
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (direct.prompt_tokens, len(direct.token_ids))


@pytest.mark.timeout(300)
def test_streamed_equals_whole_and_ends_with_usage(client: openai.OpenAI) -> None:
    messages = openai_messages(request_for(MIXES["image"]))
    whole = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=12, messages=messages)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            temperature=0,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            messages=messages,
        )
    )
    assert chunks[0].choices and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert not chunks[-1].choices and chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump() if whole.usage else False


@pytest.mark.timeout(300)
def test_image_by_url_is_fetched_once_per_request(
    client: openai.OpenAI, stack: Stack, media_url: Any, door: str
) -> None:
    image = MIXES["image"].media[0].data
    name = f"cat-{door.rsplit(':', 1)[-1].removesuffix('/v1')}.png"  # one name per door: hits counted per door
    url = media_url(name, image, "image/png")
    parts = [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "Compare."},
    ]
    by_url = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=8, messages=[{"role": "user", "content": parts}]
    )
    data_url = f"data:image/png;base64,{base64.b64encode(image).decode()}"
    inline = [{**p, "image_url": {"url": data_url}} if p["type"] == "image_url" else p for p in parts]
    by_data = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=8, messages=[{"role": "user", "content": inline}]
    )
    assert by_url.choices[0].message.content == by_data.choices[0].message.content
    assert media_url.hits[name] == 1


@pytest.mark.timeout(120)
def test_models_and_health(client: openai.OpenAI, door: str, model_path: Path) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_dump()["root"] == str(model_path.resolve())
    health = httpx.get(door.removesuffix("/v1") + "/health")
    assert health.status_code == 200 and health.json() == {"status": "serving"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"bogus": 1}, "bogus"),
        ({"temperature": 5}, "temperature"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "ftp://x/y.png"}}]}]},
            "messages[0].content[0].image_url.url",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                            {"type": "text", "text": "x"},
                        ],
                    }
                ]
            },
            "messages[0].content[0].image_url.url",
        ),
    ],
)
def test_bad_requests_are_400_naming_the_field(door: str, body: dict[str, Any], param: str) -> None:
    payload = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **body}
    reply = httpx.post(f"{door}/chat/completions", json=payload, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error


@pytest.mark.timeout(120)
def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-9", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["param"] == "model"  # type: ignore[index]


@pytest.mark.timeout(300)
def test_disconnect_mid_stream_cancels_the_calls(door: str, stack: Stack, receiver: OtlpReceiver) -> None:
    trace_id, headers = traceparent()
    disconnect_mid_stream(door, MODEL, openai_messages(request_for(MIXES["image"])), headers)
    spans = trace_spans(receiver, trace_id, lambda s: any(x.name == "GenerateService/Generate" for x in s))
    router = next(s for s in spans if s.name == "GenerateService/Generate")
    # CANCELLED: the router's server span, or in the router's door the status the call would have had
    assert router.attributes.get("rpc.grpc.status_code") == 1, router.attributes
    wait_pools_empty(stack, timeout_s=30)


@pytest.mark.timeout(300)
def test_one_trace_from_http_to_decode(door: str, receiver: OtlpReceiver) -> None:
    trace_id, headers = traceparent()
    payload = {
        "model": MODEL,
        "temperature": 0,
        "max_tokens": 4,
        "messages": openai_messages(request_for(MIXES["image"])),
    }
    reply = httpx.post(f"{door}/chat/completions", json=payload, headers=headers, timeout=120)
    assert reply.status_code == 200
    wanted = {
        "POST /v1/chat/completions",
        "GenerateService/Generate",
        "EncoderService/Encode",
        "PrefillService/Prefill",
        "DecodeService/Decode",
    }
    spans = trace_spans(receiver, trace_id, lambda s: wanted <= {x.name for x in s})
    door_span = next(s for s in spans if s.name == "POST /v1/chat/completions")
    router = next(s for s in spans if s.name == "GenerateService/Generate")
    assert door_span.parent_id == headers["traceparent"].split("-")[2]
    assert router.trace_id == trace_id and router.parent_id  # under the door's client call (or its span)
    assert door_span.start_ns <= router.start_ns and router.end_ns <= door_span.end_ns


@pytest.mark.timeout(300)
def test_completions_take_the_prompt_as_it_is(client: openai.OpenAI, stack: Stack, model_path: Path) -> None:
    """/v1/completions: the prompt tokenized as it is, no chat template (contract 1.6's raw prompt):
    the gRPC path's text for the same raw prompt, whose tokens are the model's own generate() on
    those ids; logprobs per token."""
    import torch
    from transformers import AutoTokenizer

    from tests.support.reference import load_reference, reference_generate

    prompt = "The quick brown fox jumps over"
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    ids = tokenizer.encode(prompt)
    tokens, _ = reference_generate(load_reference(str(model_path)), {"input_ids": torch.tensor([ids])}, 8)
    raw = chat_pb2.ChatMessage(role=chat_pb2.CHAT_ROLE_RAW, parts=[chat_pb2.ContentPart(text=prompt)])
    direct = run_requests(
        stack.address,
        [generate_pb2.GenerateRequest(messages=[raw], sampling=sampling_pb2.SamplingParams(max_tokens=8))],
    )[0]
    assert direct.token_ids == tokens
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=2)
    assert reply.choices[0].text == direct.text
    assert reply.usage is not None and reply.usage.prompt_tokens == len(ids)
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
    assert len(logprobs.token_logprobs) == 8 and all(len(top) <= 2 for top in logprobs.top_logprobs)
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == reply.choices[0].text


@pytest.mark.timeout(300)
def test_chat_logprobs_and_n_choices(client: openai.OpenAI) -> None:
    messages = openai_messages(request_for(MIXES["image"]))
    greedy = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=6, messages=messages, logprobs=True, top_logprobs=3
    )
    content = greedy.choices[0].logprobs.content if greedy.choices[0].logprobs else None
    assert content is not None and greedy.usage is not None and len(content) == greedy.usage.completion_tokens
    for entry in content:  # greedy: the chosen token is the most likely one
        assert len(entry.top_logprobs) == 3 and entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
    # n choices: choice i samples with seed + i, so each equals a single request with that seed.
    both = client.chat.completions.create(model=MODEL, temperature=1.0, seed=11, n=2, max_tokens=6, messages=messages)
    alone = client.chat.completions.create(model=MODEL, temperature=1.0, seed=12, max_tokens=6, messages=messages)
    assert [c.index for c in both.choices] == [0, 1]
    assert both.choices[1].message.content == alone.choices[0].message.content
    assert both.usage is not None and alone.usage is not None
    assert both.usage.prompt_tokens == alone.usage.prompt_tokens
