"""What a contract field can hold, read from the field's protobuf type, and messages built only from
values that fit.

Protobuf refuses a Python value its field cannot hold with an untyped error (`ValueError: Value out
of range`, `UnicodeEncodeError` for a string with a lone surrogate) or stores it changed (a float
beyond float32 becomes infinity). `checked` turns each of those into `InvalidArgument` naming the
field, so that whoever builds a request from values it did not make (the HTTP door, from a JSON
body) refuses them the way the services refuse a bad request. Messages that arrive over gRPC were
decoded from the wire and hold only what their fields can: for them the widths are already met and
`libs/contract/validation.py` checks the rest.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, TypeVar, cast

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from libs.contract.errors import InvalidArgument

M = TypeVar("M", bound=Message)

_INT32 = (-(1 << 31), (1 << 31) - 1)
_INT64 = (-(1 << 63), (1 << 63) - 1)
_INT_RANGES: dict[int, tuple[int, int]] = {
    FieldDescriptor.TYPE_INT32: _INT32,
    FieldDescriptor.TYPE_SINT32: _INT32,
    FieldDescriptor.TYPE_SFIXED32: _INT32,
    FieldDescriptor.TYPE_ENUM: _INT32,
    FieldDescriptor.TYPE_UINT32: (0, (1 << 32) - 1),
    FieldDescriptor.TYPE_FIXED32: (0, (1 << 32) - 1),
    FieldDescriptor.TYPE_INT64: _INT64,
    FieldDescriptor.TYPE_SINT64: _INT64,
    FieldDescriptor.TYPE_SFIXED64: _INT64,
    FieldDescriptor.TYPE_UINT64: (0, (1 << 64) - 1),
    FieldDescriptor.TYPE_FIXED64: (0, (1 << 64) - 1),
}
_TYPE_NAMES = {
    FieldDescriptor.TYPE_INT32: "int32",
    FieldDescriptor.TYPE_SINT32: "sint32",
    FieldDescriptor.TYPE_SFIXED32: "sfixed32",
    FieldDescriptor.TYPE_ENUM: "enum",
    FieldDescriptor.TYPE_UINT32: "uint32",
    FieldDescriptor.TYPE_FIXED32: "fixed32",
    FieldDescriptor.TYPE_INT64: "int64",
    FieldDescriptor.TYPE_SINT64: "sint64",
    FieldDescriptor.TYPE_SFIXED64: "sfixed64",
    FieldDescriptor.TYPE_UINT64: "uint64",
    FieldDescriptor.TYPE_FIXED64: "fixed64",
}
_FLOAT32_MAX = 3.4028234663852886e38
_COMPOSITE = (FieldDescriptor.TYPE_MESSAGE, FieldDescriptor.TYPE_GROUP)


def int_range(field: FieldDescriptor) -> tuple[int, int]:
    """The smallest and largest integer `field` holds; ValueError for a field that holds none."""
    try:
        return _INT_RANGES[field.type]
    except KeyError:
        raise ValueError(f"{field.full_name} is not an integer field") from None


def describe(value: int) -> str:
    """`value` for an error message: in full when short, else its size (a client's integer of
    thousands of digits is neither echoed nor converted: `str()` refuses over 4300 digits)."""
    return str(value) if value.bit_length() <= 64 else f"an integer of {value.bit_length()} bits"


def lone_surrogate(text: str) -> int | None:
    """The index of the first lone surrogate in `text` (a string no UTF-8 encodes), or None."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def check_value(field: FieldDescriptor, value: Any, path: str) -> None:
    """InvalidArgument at `path` when one value (not a repeated field's list) cannot be stored in
    `field` as it is."""
    if field.type in _INT_RANGES:
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgument(path, f"must be an integer, got {type(value).__name__}")
        low, high = _INT_RANGES[field.type]
        if not low <= value <= high:
            kind = _TYPE_NAMES[field.type]
            raise InvalidArgument(path, f"{describe(value)} is outside the {kind} field's range [{low}, {high}]")
    elif field.type == FieldDescriptor.TYPE_STRING:
        if not isinstance(value, str):
            raise InvalidArgument(path, f"must be a string, got {type(value).__name__}")
        at = lone_surrogate(value)
        if at is not None:
            raise InvalidArgument(path, f"holds a lone surrogate at character {at}: not valid Unicode")
    elif field.type in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidArgument(path, f"must be a number, got {type(value).__name__}")
        try:
            number = float(value)
        except OverflowError:
            raise InvalidArgument(path, f"{describe(int(value))} is beyond a floating-point field") from None
        if field.type == FieldDescriptor.TYPE_FLOAT and math.isfinite(number) and abs(number) > _FLOAT32_MAX:
            raise InvalidArgument(path, f"{number:g} is beyond the float field's range (±{_FLOAT32_MAX:g})")
    elif field.type == FieldDescriptor.TYPE_BOOL and not isinstance(value, bool):
        raise InvalidArgument(path, f"must be a boolean, got {type(value).__name__}")


def check_fields(descriptor: Descriptor, values: Mapping[str, Any], path: str) -> None:
    """InvalidArgument naming the first of `values` (scalar fields of `descriptor`, by name) that
    its field cannot hold: `path.name`, or `path.name[i]` for an entry of a repeated field."""
    for name, value in values.items():
        field = descriptor.fields_by_name[name]
        where = f"{path}.{name}" if path else name
        if field.type in _COMPOSITE:
            raise ValueError(f"{field.full_name} is a message field: build it with checked() first")
        if field.is_repeated:
            for i, item in enumerate(value):
                check_value(field, item, f"{where}[{i}]")
        else:
            check_value(field, value, where)


def checked(message: type[M], path: str, **values: Any) -> M:
    """`message(**values)` once every scalar value is known to fit its field (`check_fields`);
    message-typed values are passed as they are (messages, built by `checked` themselves)."""
    descriptor = cast(Descriptor, message.DESCRIPTOR)  # upb's descriptor type, the same API
    fields = descriptor.fields_by_name
    scalars = {name: value for name, value in values.items() if fields[name].type not in _COMPOSITE}
    check_fields(descriptor, scalars, path)
    return message(**values)
