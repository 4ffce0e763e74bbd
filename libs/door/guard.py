"""Every answer the door gives counted, and every failure logged once at its level.

`Guard` is the application's outermost own layer: it counts each response by route and status as
the response starts, and answers an exception nothing else caught with a 500 it counts too (left to
starlette's ServerErrorMiddleware, above every middleware, that 500 went out uncounted). Routes are
counted by their template; a path the door does not serve counts as `unmatched`, so a client
cannot grow /metrics by inventing paths.

Log levels: a client that left is `info` ("client disconnected", never "unexpected error"), a
refused request `info`, a failure of the stack behind the door (503, 504, ...) `warning`, an
exception of the door's own `error` with its traceback.
"""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping
from typing import Any

import structlog
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, Counter, Histogram

from libs.door.openai.errors import ApiError, excerpt

UNMATCHED = "unmatched"
CLIENT_CLOSED = 499  # nginx's status for a client that closed the connection before the answer
_log = structlog.get_logger("openai_door")


class Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter(
            "epd_door_requests", "HTTP responses by route and status", ["route", "status"], registry=self.registry
        )
        self.ttft = Histogram(
            "epd_door_time_to_first_token_seconds", "seconds to the first token, per request", registry=self.registry
        )
        self.cancelled = Counter(
            "epd_door_client_disconnects", "requests whose client left before the answer ended", registry=self.registry
        )


def log_failure(path: str, error: ApiError) -> None:
    """The one log line of a request to `path` answered with `error`."""
    route = excerpt(path)
    fields = {"route": route, "status": error.status, "code": error.code, "param": error.param}
    if error.status == CLIENT_CLOSED:
        _log.info("client disconnected", route=route)
    elif error.status >= 500:
        _log.warning("request failed", **fields, message=error.body()["error"]["message"])
    else:
        _log.info("request refused", **fields)


class Guard:
    """Counts every response by route and status, and answers (and counts) an uncaught exception as
    a 500. A plain ASGI middleware: starlette's `@app.middleware("http")` relays a streamed body
    through a queue and a task of its own, event by event, a cost every token would pay."""

    def __init__(self, app: Any, counter: Counter, routes: Iterable[str]) -> None:
        self.app = app
        self.counter = counter
        self.routes = frozenset(routes)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in self.routes else UNMATCHED
        started = False

        async def counted(message: MutableMapping[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.counter.labels(route, str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except Exception as exc:
            # Details go to the log, not to the client (as the gRPC services answer INTERNAL).
            _log.error("unexpected error", route=route, exc_info=exc)
            if started:
                raise  # the status is out and counted: only the server can end the connection now
            error = ApiError(500, "internal error", code="internal_error")
            await JSONResponse(error.body(), status_code=error.status)(scope, receive, counted)
