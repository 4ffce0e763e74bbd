"""Request-body validation shared by the OpenAI endpoints: pydantic models refuse unknown fields
(an unsupported OpenAI field is an error, never silently dropped) and name the field at fault."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pydantic

from libs.client.openai.errors import ApiError, invalid


class Body(pydantic.BaseModel):
    """A request body (or a part of one): unknown fields are refused."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)


def param_path(loc: Sequence[int | str]) -> str:
    """`messages[0].content[1].image_url.url` from pydantic's location of an error."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else part)
    return path


def parse(model: type[Body], raw: Any) -> Any:
    """The validated body, or a 400 naming the first field at fault."""
    if not isinstance(raw, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(raw)
    except pydantic.ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        loc = [p for p in first["loc"] if not _is_tag(p)]
        param = param_path(loc) or "body"
        kind = first["type"]
        message = "unknown or unsupported field" if kind == "extra_forbidden" else first["msg"]
        raise invalid(param, message) from None


def _is_tag(part: int | str) -> bool:
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool"))
