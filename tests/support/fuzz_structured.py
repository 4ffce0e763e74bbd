"""Structured generation of protobuf messages from fuzzer bytes.

Random bytes rarely parse as a deep request, so a fuzzer mutating raw wire bytes spends its time in
the parser. `build` walks a message's descriptor instead and lets the fuzzer's bytes choose every
value: which fields are set, how many repeated elements, which oneof branch, enum numbers
(including undefined ones), integers near the edges, strings and bytes. Every message it returns
is well-formed on the wire, so the validators behind the parser get exercised.
"""

from __future__ import annotations

from typing import Any

import atheris
from google.protobuf import descriptor, message

_MAX_DEPTH = 6
_MAX_REPEATED = 4
# Integers a validator is most likely to mishandle.
_EDGES = [0, 1, -1, 2, 7, 16, 255, 256, 1024, 4096, 65535, 2**31 - 1, -(2**31), 2**32 - 1, 2**53, 2**63 - 1]

_FLOAT_EDGES = [0.0, -0.0, 1.0, -1.0, 0.5, 1e-9, 1e9, float("inf"), float("-inf"), float("nan")]

F = descriptor.FieldDescriptor


def _int(fdp: atheris.FuzzedDataProvider, field: descriptor.FieldDescriptor) -> int:
    value = fdp.PickValueInList(_EDGES) if fdp.ConsumeBool() else fdp.ConsumeIntInRange(-(2**20), 2**20)
    if field.type in (F.TYPE_UINT32, F.TYPE_FIXED32):
        return int(value) % 2**32
    if field.type in (F.TYPE_UINT64, F.TYPE_FIXED64):
        return int(value) % 2**64
    if field.type in (F.TYPE_INT32, F.TYPE_SINT32, F.TYPE_SFIXED32):
        return (int(value) + 2**31) % 2**32 - 2**31
    return (int(value) + 2**63) % 2**64 - 2**63


def _scalar(fdp: atheris.FuzzedDataProvider, field: descriptor.FieldDescriptor) -> Any:
    kind = field.type
    if kind == F.TYPE_BOOL:
        return fdp.ConsumeBool()
    if kind in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        if fdp.ConsumeIntInRange(0, 3) == 0:
            return fdp.PickValueInList(_FLOAT_EDGES)
        return fdp.ConsumeFloatInRange(-1e6, 1e6)
    if kind == F.TYPE_STRING:
        return fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 64))
    if kind == F.TYPE_BYTES:
        return fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 256))
    if kind == F.TYPE_ENUM:
        numbers = [v.number for v in field.enum_type.values]
        return fdp.PickValueInList(numbers) if fdp.ConsumeIntInRange(0, 7) else fdp.ConsumeIntInRange(-3, 64)
    return _int(fdp, field)


def fill(fdp: atheris.FuzzedDataProvider, msg: message.Message, depth: int = 0) -> None:
    """Set a fuzzer-chosen subset of `msg`'s fields, recursively."""
    chosen_oneofs: set[str] = set()
    for field in msg.DESCRIPTOR.fields:
        if fdp.remaining_bytes() == 0:
            return
        oneof = field.containing_oneof
        if oneof is not None and not oneof.name.startswith("_"):
            if oneof.name in chosen_oneofs or not fdp.ConsumeBool():
                continue
            chosen_oneofs.add(oneof.name)
        elif not fdp.ConsumeBool():
            continue
        repeated = field.is_repeated
        count = fdp.ConsumeIntInRange(0, _MAX_REPEATED) if repeated else 1
        for _ in range(count):
            if field.type == F.TYPE_MESSAGE:
                if depth >= _MAX_DEPTH:
                    break
                if field.message_type.GetOptions().map_entry:
                    continue  # EPD's contract has no maps
                child = getattr(msg, field.name).add() if repeated else getattr(msg, field.name)
                child.SetInParent()
                fill(fdp, child, depth + 1)
            elif repeated:
                getattr(msg, field.name).append(_scalar(fdp, field))
            else:
                setattr(msg, field.name, _scalar(fdp, field))


def build(fdp: atheris.FuzzedDataProvider, cls: type[message.Message]) -> message.Message:
    msg = cls()
    fill(fdp, msg)
    return msg
