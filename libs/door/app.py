"""The ASGI application: OpenAI's routes over the router's `Generate` (FastAPI, as vLLM's server).

Each request is validated (a JSON body, strictly typed, unknown fields refused: libs/door/openai),
its media fetched (bounded, SSRF-safe, the bytes held to the part's kind: `libs/fetch`), turned into
one `GenerateRequest` per choice (every value within its contract field's width and the router's
limits) and streamed back as OpenAI's objects or SSE chunks. Errors, unknown routes included, are
OpenAI error objects (`libs/door/openai/errors.py`); every response is counted and every failure
logged once (`libs/door/guard.py`). A client that disconnects cancels its calls; `traceparent`
continues into the router's spans.
"""

from __future__ import annotations

import asyncio
import hashlib
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
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.datastructures import UploadFile as StarletteUpload
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from tokenizers import Tokenizer

from libs.contract.chunks import merge_responses
from libs.contract.epd.v1 import generate_pb2, generation_pb2, media_pb2
from libs.door.calls import GenerateCall
from libs.door.calls import responses as choice_responses
from libs.door.gate import TICKET, Gate, Ticket
from libs.door.guard import CLIENT_CLOSED, Guard, Metrics, log_failure
from libs.door.openai import body as json_body
from libs.door.openai import chat, completions, errors, responses, transcription
from libs.door.openai.errors import ApiError, excerpt
from libs.door.openai.fields import parse
from libs.fetch import FetchClient, MediaFetchError, checked_media_type
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
    body_timeout_s: float = 60.0  # from a request's headers to the end of its body (408 beyond)


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


def tenant_salt(token: str | None, asked: str | None) -> str:
    """A request's scope for cached prefixes (contract 1.8 `cache_salt`). With bearer tokens, the
    caller's token, hashed, then the body's `cache_salt` inside it: a caller can split its own
    scope but never name another caller's. Without tokens the door knows no caller: the body's
    salt, or the deployment's one scope."""
    if token is None:
        return asked or ""
    caller = hashlib.sha256(b"epd.tenant\0" + token.encode()).hexdigest()[:32]
    return f"{caller}/{asked}" if asked else caller


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
        raise _client_closed()
    return task.result()


def _client_closed() -> ApiError:
    return ApiError(CLIENT_CLOSED, "the client closed the connection", code="client_closed_request")


_KINDS = {media_pb2.MODALITY_IMAGE: "image", media_pb2.MODALITY_VIDEO: "video", media_pb2.MODALITY_AUDIO: "audio"}


def create_app(
    config: DoorConfig,
    generate: GenerateCall,
    fetch: FetchClient,
    health: Callable[[], Awaitable[bool]],
    registry: CollectorRegistry | None = None,
    gate: Gate | None = None,
) -> fastapi.FastAPI:
    """The application; its instruments go into `registry` (a new one when None), which its
    /metrics serves. `gate` refuses a request at its arrival, before its body is read, when the
    router would refuse it (libs/door/gate.py); None: no such bound (the router's still holds)."""
    gate = gate or Gate(1 << 62, lambda: 0)
    # No redirect from `/v1/chat/completions/` to the route: a path the door does not serve is a 404.
    app = fastapi.FastAPI(
        title="EPD OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False
    )
    metrics = Metrics(CollectorRegistry() if registry is None else registry)
    app.state.metrics = metrics  # the server counts the answers its connections give (libs/door/connections.py)

    @app.exception_handler(ApiError)
    async def api_error(request: fastapi.Request, exc: ApiError) -> JSONResponse:
        log_failure(request.url.path, exc)
        if exc.status == CLIENT_CLOSED:
            metrics.cancelled.inc()
        return _error_response(exc)

    @app.exception_handler(HTTPException)
    async def http_error(request: fastapi.Request, exc: HTTPException) -> JSONResponse:
        """Starlette's own refusals (no such route, a method the route does not take) as OpenAI's."""
        where = f"{request.method} {excerpt(request.url.path)}"
        if exc.status_code == 404:
            error = ApiError(404, f"Invalid URL ({where})", code="unknown_url")
        elif exc.status_code == 405:
            error = ApiError(
                405, f"Method not allowed ({where})", code="method_not_allowed", headers=dict(exc.headers or {})
            )
        else:
            error = ApiError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {}))
        return await api_error(request, error)

    def authorize(request: fastapi.Request) -> str | None:
        """The caller's bearer token (passed on to the router); 401 when tokens are configured and
        it is missing or unknown."""
        header = request.headers.get("authorization", "")
        token = header[7:].strip() if header.lower().startswith("bearer ") else None
        if config.tokens and not (token and any(hmac.compare_digest(token, t) for t in config.tokens)):
            raise ApiError(401, "missing or unknown bearer token", code="invalid_api_key")
        return token

    def check_length(request: fastapi.Request, field: str) -> None:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > config.max_body_bytes:
            raise errors.too_large(field, f"{excerpt(length)} bytes, limit {config.max_body_bytes}")

    async def body_of(request: fastapi.Request) -> Any:
        json_body.require_json(request.headers.get("content-type"))
        check_length(request, "body")
        raw = bytearray()
        try:
            async with asyncio.timeout(config.body_timeout_s):
                async for piece in request.stream():
                    raw += piece
                    if len(raw) > config.max_body_bytes:
                        raise errors.too_large("body", f"over {config.max_body_bytes} bytes")
        except ClientDisconnect:
            raise _client_closed() from None
        except TimeoutError:
            raise body_timed_out("body") from None
        return json_body.load(bytes(raw))

    def body_timed_out(field: str) -> ApiError:
        # The connection closes after it: the rest of the body would otherwise still be read.
        return ApiError(
            408,
            f"the request body did not arrive within {config.body_timeout_s:g} s",
            param=field,
            code="request_timeout",
            headers={"Connection": "close"},
        )

    def check_model(model: str) -> None:
        if model not in (config.served_model, str(config.model_root)):
            raise ApiError(
                404,
                f"model {excerpt(model)!r} is not served here (this server serves {config.served_model!r})",
                param="model",
                code="model_not_found",
            )

    async def fetched_media(body: chat.ChatCompletionRequest) -> dict[str, media_pb2.MediaItem]:
        fetcher = fetch.for_request()
        try:
            parts = chat.media_parts(body)

            async def one(path: str, part: chat.MediaPart) -> tuple[str, media_pb2.MediaItem]:
                modality, url = chat.media_source(part)
                inline = url[:5].lower() == "data:"
                try:
                    got = await fetcher.fetch(url)
                    mime_type = checked_media_type(_KINDS[modality], got, claimed_by_client=inline)
                except MediaFetchError as exc:
                    field = chat.source_field(path, part)
                    if exc.kind == "too_large":
                        raise errors.too_large(field, str(exc)) from None
                    raise errors.invalid(field, str(exc)) from None
                return path, media_pb2.MediaItem(modality=modality, data=got.data, mime_type=mime_type, id=path)

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
        ticket: Ticket,
        media_fields: Sequence[str] = (),
    ) -> Response:
        """The choices' `Generate` calls, answered whole or as SSE. A stream waits for the router's
        first answer before its 200 goes out, so a refusal (429, 503, ...) keeps its status; one
        server span covers the request, to the stream's end. `ticket` (the gate's) is handed on as
        the calls start."""
        span = _tracer.start_span(route, context=propagate.extract(dict(request.headers)), kind=SpanKind.SERVER)
        started = time.perf_counter()
        choices = [responses.Choice(i) for i in range(render.n)]

        def failed(exc: BaseException) -> BaseException:
            if isinstance(exc, ApiError):
                exc = errors.relocate(exc, media_fields)
                _record(span, exc)
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
                requests = await prepared()
                ticket.called()
                async for index, response in choice_responses(generate, requests, render.token):
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
                requests = await _unless_disconnected(request, prepared())
                ticket.called()
                calls = choice_responses(generate, requests, render.token)
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
                except Exception as exc:
                    # Past the 200: OpenAI's servers report a mid-stream failure as an error event.
                    finished = True
                    if not isinstance(exc, ApiError):
                        _log.error("unexpected error", route=request.url.path, exc_info=exc)
                        exc = ApiError(500, "internal error", code="internal_error")
                    else:
                        log_failure(request.url.path, exc)
                    yield responses.sse(cast(ApiError, failed(exc)).body())
                    yield responses.DONE
                finally:
                    await stream.aclose()  # a client gone: its calls cancelled now, not when collected
                    if not finished:
                        span.add_event("client disconnected")
                        span.set_status(Status(StatusCode.ERROR, "client disconnected"))
                        metrics.cancelled.inc()
                        _log.info("client disconnected", route=request.url.path, during="stream")

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    turn = asyncio.Lock()

    async def in_turn(work: Callable[[], T]) -> T:
        """`work` (a request's CPU-bound step: parsing its body, building its calls) in its turn: one
        such step per pass of the event loop, each pass polling the sockets first. Without turns a
        burst's admitted requests ran these steps back to back, holding the loop for seconds, and
        the connections' refusals (libs/door/connections.py), which run when the loop polls,
        waited behind them; the work itself is serial either way."""
        async with turn:
            await asyncio.sleep(0)  # the others queue behind: the next turn is the next pass's
            return work()

    def request_id_of(request: fastapi.Request) -> str:
        return request.headers.get("x-request-id") or uuid.uuid4().hex

    @app.post("/v1/chat/completions")
    async def chat_completions(request: fastapi.Request) -> Response:
        with gate.arrival(request.scope.get(TICKET)) as ticket:  # its place, before anything is read
            token = authorize(request)
            raw = await body_of(request)
            body: chat.ChatCompletionRequest = await in_turn(lambda: parse(chat.ChatCompletionRequest, raw))
            check_model(body.model)
            request_id = request_id_of(request)
            envelope = responses.Envelope(f"chatcmpl-{request_id}", body.model, int(time.time()))

            async def prepared() -> list[generate_pb2.GenerateRequest]:
                media = await fetched_media(body)
                temperature = config.default_temperature
                salt = tenant_salt(token, body.cache_salt)
                return await in_turn(
                    lambda: [
                        chat.generate_request(
                            body,
                            media,
                            request_id=request_id,
                            choice=i,
                            default_temperature=temperature,
                            cache_salt=salt,
                        )
                        for i in range(body.n)
                    ]
                )

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
            return await answer(request, "POST /v1/chat/completions", prepared, render, ticket, media_fields)

    @app.post("/v1/completions")
    async def text_completions(request: fastapi.Request) -> Response:
        with gate.arrival(request.scope.get(TICKET)) as ticket:  # its place, before anything is read
            token = authorize(request)
            raw = await body_of(request)
            body: completions.CompletionRequest = await in_turn(lambda: parse(completions.CompletionRequest, raw))
            check_model(body.model)
            request_id = request_id_of(request)
            envelope = responses.Envelope(f"cmpl-{request_id}", body.model, int(time.time()))
            temperature = config.default_temperature
            salt = tenant_salt(token, body.cache_salt)
            requests = [
                completions.generate_request(
                    body, request_id=request_id, choice=i, default_temperature=temperature, cache_salt=salt
                )
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
            return await answer(request, "POST /v1/completions", prepared, render, ticket)

    @app.post("/v1/audio/transcriptions")
    async def transcriptions(request: fastapi.Request) -> Response:
        span_context = propagate.extract(dict(request.headers))
        with gate.arrival(request.scope.get(TICKET)) as ticket:  # its place, before anything is read
            token = authorize(request)
            if config.speech is None:
                raise ApiError(
                    404,
                    f"{config.served_model!r} is not a speech model: no transcriptions here",
                    code="model_not_found",
                )
            form_type = request.headers.get("content-type", "")
            if form_type.partition(";")[0].strip().lower() != "multipart/form-data":
                shown = excerpt(form_type) if form_type else "none"
                raise ApiError(
                    415, f"the body must be sent as multipart/form-data (got {shown})", code="unsupported_media_type"
                )
            check_length(request, "file")
            try:
                async with asyncio.timeout(config.body_timeout_s):
                    form = await request.form(
                        max_files=1, max_fields=len(transcription.FIELDS), max_part_size=config.max_body_bytes
                    )
            except ClientDisconnect:
                raise _client_closed() from None
            except TimeoutError:
                raise body_timed_out("file") from None
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

                ticket.called()
                try:
                    chunks = await _unless_disconnected(request, whole())
                except ApiError as exc:
                    _record(span, exc)
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

    routes = [route.path for route in app.routes if isinstance(route, fastapi.routing.APIRoute)]
    app.add_middleware(Guard, counter=metrics.requests, routes=routes)
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


def _record(span: trace.Span, exc: ApiError) -> None:
    span.set_attribute("http.response.status_code", exc.status)
    span.set_status(Status(StatusCode.ERROR, exc.message[:200]))
    if exc.status == CLIENT_CLOSED:
        span.add_event("client disconnected")


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
