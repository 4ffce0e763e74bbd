"""A request body as JSON, refused with a 400 (415 for its media type) for whatever cannot become a
request: a media type other than `application/json`, bytes that are not UTF-8 JSON (RFC 8259: no
NaN or Infinity), nesting past the parser's bound, and strings no UTF-8 encodes (a lone surrogate
escape, `"\\ud800"`), named by their field.

The parser (jiter, pydantic's) bounds nesting itself, so a body nested ten thousand deep is one
error, not a RecursionError; it refuses a lone surrogate too, without saying where. Only then is
the body parsed again with the standard library, which keeps lone surrogates, to name the field
holding one: a refused request pays the second parse, an accepted one never does.
"""

from __future__ import annotations

import json
from typing import Any

import pydantic_core

from libs.contract.bounds import lone_surrogate
from libs.door.openai.errors import ApiError, excerpt, invalid

JSON_TYPE = "application/json"
# What the parser refuses past this depth says so; its bound is fixed (jiter's recursion limit).
_TOO_DEEP = "recursion limit"


def require_json(content_type: str | None) -> None:
    """415 unless the body's declared type is `application/json` (charset, if any, UTF-8). A body
    of another type would be served otherwise: a cross-site form or `text/plain` POST needs no
    CORS preflight, so without this check any web page the operator opens could call the door."""
    media, _, params = (content_type or "").partition(";")
    charset = "utf-8"
    for param in params.split(";"):
        key, _, value = param.partition("=")
        if key.strip().lower() == "charset":
            charset = value.strip().strip('"').lower()
    if media.strip().lower() != JSON_TYPE or charset not in ("utf-8", "utf8"):
        shown = excerpt(content_type) if content_type else "none"
        raise ApiError(
            415, f"the body must be sent as Content-Type: {JSON_TYPE} (got {shown})", code="unsupported_media_type"
        )


def load(raw: bytes) -> Any:
    """The parsed body, or a 400: `body` for what is not JSON or nests too deep, the field's path
    for a string holding a lone surrogate."""
    try:
        return pydantic_core.from_json(raw, allow_inf_nan=False)
    except ValueError as exc:
        refused = str(exc)
    if _TOO_DEEP in refused:
        raise ApiError(400, "the request body nests too deeply", param="body", code="invalid_json")
    try:
        again = json.loads(raw, parse_constant=_not_json)
    except (ValueError, UnicodeDecodeError, RecursionError):
        again = None
    where = surrogate_path(again) if again is not None else None
    if where is not None:
        raise invalid(excerpt(where, 128), "holds a lone surrogate (\\ud800-\\udfff unpaired): not valid Unicode")
    raise ApiError(400, f"the request body is not JSON: {refused}", param="body", code="invalid_json")


def surrogate_path(value: Any) -> str | None:
    """The path (`messages[0].content`) of the first string, or key, holding a lone surrogate in a
    parsed body; walked without recursion, so any depth the parser took is safe."""
    pending: list[tuple[str, Any]] = [("", value)]
    while pending:
        path, item = pending.pop()
        if isinstance(item, str):
            if lone_surrogate(item) is not None:
                return path or "body"
        elif isinstance(item, dict):
            for key, child in reversed(item.items()):
                if lone_surrogate(key) is not None:
                    return f"{path}.{_shown(key)}" if path else _shown(key)
                pending.append((f"{path}.{key}" if path else key, child))
        elif isinstance(item, list):
            pending.extend((f"{path}[{i}]", child) for i, child in reversed(list(enumerate(item))))
    return None


def _shown(key: str) -> str:
    """A key holding a lone surrogate, as text an error body can carry (`\\ud800` escaped)."""
    return excerpt(key.encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace"))


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")
