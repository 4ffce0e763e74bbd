"""The ASGI application: OpenAI's routes over the router's `Generate` (FastAPI, as vLLM's server).

Each request is validated (pydantic; unknown fields refused), its media fetched (bounded,
SSRF-safe: `libs/fetch`), turned into one `GenerateRequest` per choice and streamed back as
OpenAI's objects or SSE chunks. Errors are OpenAI error objects (`libs/door/openai/errors.py`).
A client that disconnects cancels its calls; `traceparent` continues into the router's spans.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import fastapi
import structlog
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from starlette.datastructures import UploadFile as StarletteUpload
from tokenizers import Tokenizer

from libs.contract.chunks import merge_responses
from libs.contract.epd.v1 import generate_pb2, generation_pb2, media_pb2
from libs.door.calls import GenerateCall
from libs.door.calls import responses as choice_responses
from libs.door.openai import chat, completions, errors, responses, transcription
from libs.door.openai.errors import ApiError
from libs.door.openai.fields import parse
from libs.fetch import FetchClient, MediaFetchError
from libs.rpc.coalesce import coalesced

T = TypeVar("T")
_log = structlog.get_logger("openai_door")
_tracer = trace.get_tracer("epd.openai_door")


@dataclass(frozen=True)
class DoorConfig:
    served_model: str  # the model id clients send and /v1/models lists
    model_root: Path  # the checkpoint directory (/v1/models `root`: where clients find the tokenizer)
    default_temperature: float
    max_body_bytes: int
    tokens: frozenset[str]  # bearer tokens the door accepts (empty: none needed), passed on to the router
    # What transcription needs of a speech model's vocabulary (Whisper), else None.
    speech: SpeechVocab | None = None


@dataclass(frozen=True)
class Rendering:
    """How one endpoint answers: its calls, whole or streamed, and its OpenAI objects."""

    token: str | None  # the client's bearer token, passed on to the router
    n: int  # choices
    stream: bool
    include_usage: bool  # a last chunk with the usage and no choices (stream_options.include_usage)
    whole: Callable[[list[responses.Choice]], dict[str, Any]]
    chunk: Callable[[int, generation_pb2.TokenChunk, bool], dict[str, Any]]  # (choice, chunk, first)
    usage: Callable[[list[responses.Choice]], dict[str, Any]]


class Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter(
            "epd_door_requests", "HTTP requests by route and status", ["route", "status"], registry=self.registry
        )
        self.ttft = Histogram(
            "epd_door_time_to_first_token_seconds", "seconds to the first token, per request", registry=self.registry
        )
        self.cancelled = Counter(
            "epd_door_client_disconnects", "requests whose client left before the answer ended", registry=self.registry
        )


class _CountRequests:
    """Requests by route and status, counted as the answer starts. A plain ASGI middleware:
    starlette's `@app.middleware("http")` relays a streamed body through a queue and a task of its
    own, event by event, a cost every token of every stream would pay."""

    def __init__(self, app: Any, counter: Counter) -> None:
        self.app = app
        self.counter = counter

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counted(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                self.counter.labels(scope["path"], str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)


def _error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def _until_disconnected(request: fastapi.Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: fastapi.Request, work: Awaitable[T]) -> T:
    """`work`, cancelled (its calls with it) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        raise ApiError(499, "the client closed the connection", code="client_closed_request")
    return task.result()


def create_app(
    config: DoorConfig,
    generate: GenerateCall,
    fetch: FetchClient,
    health: Callable[[], Awaitable[bool]],
    registry: CollectorRegistry | None = None,
) -> fastapi.FastAPI:
    """The application; its instruments go into `registry` (a new one when None), which its
    /metrics serves."""
    app = fastapi.FastAPI(title="EPD OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = Metrics(CollectorRegistry() if registry is None else registry)

    @app.exception_handler(ApiError)
    async def api_error(request: fastapi.Request, exc: ApiError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(Exception)
    async def unexpected(request: fastapi.Request, exc: Exception) -> JSONResponse:
        # Details go to the log, not to the client (as the gRPC services answer INTERNAL).
        _log.error("unexpected error", path=request.url.path, exc_info=exc)
        return _error_response(ApiError(500, "internal error", code="internal_error"))

    app.add_middleware(_CountRequests, counter=metrics.requests)

    def authorize(request: fastapi.Request) -> str | None:
        """The caller's bearer token (passed on to the router); 401 when tokens are configured and
        it is missing or unknown."""
        header = request.headers.get("authorization", "")
        token = header[7:].strip() if header.lower().startswith("bearer ") else None
        if config.tokens and not (token and any(hmac.compare_digest(token, t) for t in config.tokens)):
            raise ApiError(401, "missing or unknown bearer token", code="invalid_api_key")
        return token

    async def body_of(request: fastapi.Request) -> Any:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > config.max_body_bytes:
            raise errors.too_large("body", f"{length} bytes, limit {config.max_body_bytes}")
        raw = bytearray()
        async for piece in request.stream():
            raw += piece
            if len(raw) > config.max_body_bytes:
                raise errors.too_large("body", f"over {config.max_body_bytes} bytes")
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the request body is not JSON: {exc}", code="invalid_json") from None

    def check_model(model: str) -> None:
        if model not in (config.served_model, str(config.model_root)):
            raise ApiError(
                404,
                f"model {model!r} is not served here (this server serves {config.served_model!r})",
                param="model",
                code="model_not_found",
            )

    async def fetched_media(body: chat.ChatCompletionRequest) -> dict[str, media_pb2.MediaItem]:
        fetcher = fetch.for_request()
        try:
            parts = chat.media_parts(body)

            async def one(path: str, part: chat.MediaPart) -> tuple[str, media_pb2.MediaItem]:
                modality, url = chat.media_source(part)
                try:
                    got = await fetcher.fetch(url)
                except MediaFetchError as exc:
                    field = chat.source_field(path, part)
                    if exc.kind == "too_large":
                        raise errors.too_large(field, str(exc)) from None
                    raise errors.invalid(field, str(exc)) from None
                return path, media_pb2.MediaItem(modality=modality, data=got.data, mime_type=got.mime_type, id=path)

            return dict(await asyncio.gather(*(one(p, part) for p, part in parts)))
        finally:
            await fetcher.close()

    @app.get("/health")
    async def get_health() -> Response:
        ok = await health()
        return JSONResponse({"status": "serving" if ok else "not_serving"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return PlainTextResponse(generate_latest(metrics.registry).decode(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models(request: fastapi.Request) -> Response:
        authorize(request)
        model = {
            "id": config.served_model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "epd",
            "root": str(config.model_root),
            "parent": None,
        }
        return JSONResponse({"object": "list", "data": [model]})

    async def answer(
        request: fastapi.Request,
        route: str,
        prepared: Callable[[], Awaitable[list[generate_pb2.GenerateRequest]]],
        render: Rendering,
        media_fields: Sequence[str] = (),
    ) -> Response:
        """The choices' `Generate` calls, answered whole or as SSE. A stream waits for the router's
        first answer before its 200 goes out, so a refusal (429, 503, ...) keeps its status; one
        server span covers the request, to the stream's end."""
        span = _tracer.start_span(route, context=propagate.extract(dict(request.headers)), kind=SpanKind.SERVER)
        started = time.perf_counter()
        choices = [responses.Choice(i) for i in range(render.n)]

        def failed(exc: BaseException) -> BaseException:
            if isinstance(exc, ApiError):
                exc = errors.relocate(exc, media_fields)
                _record(span, exc, metrics)
            return exc

        def add(index: int, response: generate_pb2.GenerateResponse) -> bool:
            """Whether this is the choice's first response."""
            if response.chunk.token_ids and not any(c.chunks for c in choices):
                metrics.ttft.observe(time.perf_counter() - started)
            first = not choices[index].chunks
            choices[index].add(response)
            return first

        if not render.stream:

            async def whole() -> dict[str, Any]:
                async for index, response in choice_responses(generate, await prepared(), render.token):
                    add(index, response)
                return render.whole(choices)

            with trace.use_span(span, end_on_exit=True):
                try:
                    return JSONResponse(await _unless_disconnected(request, whole()))
                except BaseException as exc:
                    raise failed(exc) from None

        try:
            with trace.use_span(span):
                # A client that lags gets the tokens that queued up meanwhile as one event.
                calls = choice_responses(generate, await _unless_disconnected(request, prepared()), render.token)
                stream = coalesced(calls, _same_choice)
                head = await _unless_disconnected(request, anext(stream, None))
        except BaseException as exc:
            span.end()
            raise failed(exc) from None

        async def events() -> AsyncIterator[str]:
            finished = False
            with trace.use_span(span, end_on_exit=True):
                try:
                    async for index, response in _prepend(head, stream):
                        first = add(index, response)
                        if response.chunk.text or response.chunk.finish_reason or first:
                            yield responses.sse(render.chunk(index, response.chunk, first))
                    if render.include_usage:
                        yield responses.sse(render.usage(choices))
                    finished = True
                    yield responses.DONE
                except ApiError as exc:
                    # Past the 200: OpenAI's servers report a mid-stream failure as an error event.
                    finished = True
                    yield responses.sse(cast(ApiError, failed(exc)).body())
                    yield responses.DONE
                finally:
                    await stream.aclose()  # a client gone: its calls cancelled now, not when collected
                    if not finished:
                        span.add_event("client disconnected")
                        span.set_status(Status(StatusCode.ERROR, "client disconnected"))
                        metrics.cancelled.inc()

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    def request_id_of(request: fastapi.Request) -> str:
        return request.headers.get("x-request-id") or uuid.uuid4().hex

    @app.post("/v1/chat/completions")
    async def chat_completions(request: fastapi.Request) -> Response:
        token = authorize(request)
        body: chat.ChatCompletionRequest = parse(chat.ChatCompletionRequest, await body_of(request))
        check_model(body.model)
        request_id = request_id_of(request)
        envelope = responses.Envelope(f"chatcmpl-{request_id}", body.model, int(time.time()))

        async def prepared() -> list[generate_pb2.GenerateRequest]:
            media = await fetched_media(body)
            temperature = config.default_temperature
            return [
                chat.generate_request(body, media, request_id=request_id, choice=i, default_temperature=temperature)
                for i in range(body.n)
            ]

        render = Rendering(
            token=token,
            n=body.n,
            stream=body.stream,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            whole=lambda choices: envelope.chat_completion(choices, body.logprobs),
            chunk=lambda i, chunk, first: envelope.chat_chunk(i, chunk, first=first, logprobs=body.logprobs),
            usage=lambda choices: envelope.usage_chunk("chat.completion.chunk", choices),
        )
        media_fields = [chat.source_field(path, part) for path, part in chat.media_parts(body)]
        return await answer(request, "POST /v1/chat/completions", prepared, render, media_fields)

    @app.post("/v1/completions")
    async def text_completions(request: fastapi.Request) -> Response:
        token = authorize(request)
        body: completions.CompletionRequest = parse(completions.CompletionRequest, await body_of(request))
        check_model(body.model)
        request_id = request_id_of(request)
        envelope = responses.Envelope(f"cmpl-{request_id}", body.model, int(time.time()))
        temperature = config.default_temperature
        requests = [
            completions.generate_request(body, request_id=request_id, choice=i, default_temperature=temperature)
            for i in range(body.n)
        ]

        async def prepared() -> list[generate_pb2.GenerateRequest]:
            return requests

        with_logprobs = body.logprobs is not None
        render = Rendering(
            token=token,
            n=body.n,
            stream=body.stream,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            whole=lambda choices: envelope.text_completion(choices, with_logprobs),
            chunk=lambda i, chunk, first: envelope.text_chunk(i, chunk, logprobs=with_logprobs),
            usage=lambda choices: envelope.usage_chunk("text_completion", choices),
        )
        return await answer(request, "POST /v1/completions", prepared, render)

    @app.post("/v1/audio/transcriptions")
    async def transcriptions(request: fastapi.Request) -> Response:
        span_context = propagate.extract(dict(request.headers))
        token = authorize(request)
        if config.speech is None:
            raise ApiError(
                404, f"{config.served_model!r} is not a speech model: no transcriptions here", code="model_not_found"
            )
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > config.max_body_bytes:
            raise errors.too_large("file", f"{length} bytes, limit {config.max_body_bytes}")
        try:
            form = await request.form(
                max_files=1, max_fields=len(transcription.FIELDS), max_part_size=config.max_body_bytes
            )
        except Exception as exc:
            raise ApiError(400, f"the request is not a valid multipart form: {exc}", code="invalid_form") from None
        upload = form.get("file")
        audio, mime = (
            (await upload.read(), upload.content_type or "") if isinstance(upload, StarletteUpload) else (b"", "")
        )
        parsed = transcription.parse_form(dict(form.items()), audio, mime)
        check_model(parsed.model)
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        with _tracer.start_as_current_span(
            "POST /v1/audio/transcriptions", context=span_context, kind=SpanKind.SERVER
        ) as span:

            async def whole() -> list[tuple[list[int], str]]:
                got = []
                one = [transcription.request_for(parsed, request_id)]
                async for _, response in choice_responses(generate, one, token):
                    got.append((list(response.chunk.token_ids), response.chunk.text))
                return got

            try:
                chunks = await _unless_disconnected(request, whole())
            except ApiError as exc:
                _record(span, exc, metrics)
                raise
        text = "".join(t for _, t in chunks).strip()
        if parsed.response_format == "text":
            return PlainTextResponse(text + "\n")
        if parsed.response_format == "json":
            return JSONResponse({"text": text})
        assert config.speech is not None
        tokens = [t for ids, _ in chunks for t in ids]
        found = transcription.segments(tokens, config.speech.timestamp_begin, config.speech.decode)
        return JSONResponse(transcription.verbose(text, found, transcription.duration_s(parsed.audio)))

    return app


def _same_choice(
    earlier: tuple[int, generate_pb2.GenerateResponse], later: tuple[int, generate_pb2.GenerateResponse]
) -> tuple[int, generate_pb2.GenerateResponse] | None:
    return (earlier[0], merge_responses(earlier[1], later[1])) if earlier[0] == later[0] else None


async def _prepend(head: T | None, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    if head is not None:
        yield head
    async for item in rest:
        yield item


def _record(span: trace.Span, exc: ApiError, metrics: Metrics) -> None:
    span.set_attribute("http.response.status_code", exc.status)
    span.set_status(Status(StatusCode.ERROR, exc.message[:200]))
    if exc.status == 499:
        span.add_event("client disconnected")
        metrics.cancelled.inc()


@dataclass(frozen=True)
class SpeechVocab:
    timestamp_begin: int  # id of <|0.00|>, the token after <|notimestamps|>
    decode: Callable[[list[int]], str]  # token ids -> text, special tokens left out


def whisper_vocab(checkpoint: Path) -> SpeechVocab | None:
    """A Whisper checkpoint's tokenizer (tokenizer.json, with the `tokenizers` library: no model
    code), or None for a checkpoint that is not Whisper."""
    try:
        config = json.loads((checkpoint / "config.json").read_text())
    except (OSError, ValueError):
        return None  # not a checkpoint this host can read (a path only the pods have)
    if config.get("model_type") != "whisper":
        return None
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))  # a broken one stops the door
    begin = tokenizer.token_to_id("<|notimestamps|>")
    if begin is None:
        return None
    return SpeechVocab(begin + 1, lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True)))
