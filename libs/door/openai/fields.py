"""Request-body validation shared by the OpenAI endpoints: pydantic models refuse unknown fields
(an unsupported OpenAI field is an error, never silently dropped) and values of another JSON type
(strict: `"0.5"` is no temperature, `"yes"` no boolean, `true` no integer), and name the field at
fault."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pydantic

from libs.door.openai.errors import ApiError, excerpt, invalid


class Body(pydantic.BaseModel):
    """A request body (or a part of one): unknown fields are refused, and so is a value of another
    type than its field's (pydantic's lax mode would take `"0.5"` for 0.5 and `true` for 1); an
    integer stands for a float, as JSON does not tell them apart."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, strict=True)


def param_path(loc: Sequence[int | str]) -> str:
    """`messages[0].content[1].image_url.url` from pydantic's location of an error."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else part)
    return path


def parse(model: type[Body], raw: Any) -> Any:
    """The validated body, or a 400 naming the most specific field at fault."""
    if not isinstance(raw, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(raw)
    except pydantic.ValidationError as exc:
        # A union reports one error per member: the deepest names the field the client got wrong.
        first = max(exc.errors(include_url=False), key=lambda e: len(_field_loc(e["loc"])))
        param = excerpt(param_path(_field_loc(first["loc"])), 128) or "body"
        message = "unknown or unsupported field" if first["type"] == "extra_forbidden" else first["msg"]
        raise invalid(param, message) from None


def _field_loc(loc: Sequence[int | str]) -> list[int | str]:
    """pydantic's location without the union members it names: type names (`str`, `list[...]`)
    and the tag of a tagged union, which repeats the field after it (`content[1].image_url.image_url`)."""
    kept: list[int | str] = []
    for i, part in enumerate(loc):
        if isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool")):
            continue
        if isinstance(part, str) and kept and isinstance(kept[-1], int) and i + 1 < len(loc) and loc[i + 1] == part:
            continue
        kept.append(part)
    return kept
