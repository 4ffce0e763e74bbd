"""Reader for CTranslate2's `model.bin` (the project's own; the ctranslate2 package is not needed).

Format, as written by `ctranslate2/specs/model_spec.py` (`ModelSpec._serialize`) and read by
`src/models/model.cc` (`Model::load`), all little-endian:

    u32 binary version (3..6 read here)
    str spec name ("WhisperSpec"), u32 spec revision
    u32 variable count, then per variable:
        str name ("encoder/layer_0/self_attention/linear_0/weight")
        u8 rank, rank x u32 dimensions
        version >= 4: u8 type id (float32, int8, int16, int32, float16, bfloat16 in that order), u32 bytes
        version 3:    u8 item size, u32 element count
        the raw bytes
    u32 alias count, then pairs of str (alias, variable name)   (version >= 3)

where `str` is u16 length (including a trailing NUL), the UTF-8 bytes, and the NUL. Every length is
checked against the file before it is used, so a truncated or hostile file raises
`CheckpointError` rather than reading past its end or allocating what it claims.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from libs.model.errors import CheckpointError

# Order of CTranslate2's DataType enum (include/ctranslate2/types.h).
_DTYPES: tuple[np.dtype, ...] = (
    np.dtype("float32"),
    np.dtype("int8"),
    np.dtype("int16"),
    np.dtype("int32"),
    np.dtype("float16"),
    np.dtype("uint16"),  # bfloat16: kept as raw 16-bit words, widened by `as_float32`
)
_BFLOAT16 = 5
_BY_ITEM_SIZE = {4: 0, 1: 1, 2: 2}  # version 3 stored only the item size: float32, int8, int16
SUPPORTED_VERSIONS = range(3, 7)
_MAX_RANK = 8


@dataclass(frozen=True)
class Ct2Variable:
    name: str
    array: np.ndarray  # a read-only view of the file's bytes
    type_id: int

    def as_float32(self) -> np.ndarray:
        if self.type_id == _BFLOAT16:
            return (self.array.astype(np.uint32) << 16).view(np.float32)
        return self.array.astype(np.float32)

    def scalar(self) -> int:
        if self.array.size != 1:
            raise CheckpointError(f"{self.name}: expected a scalar, shape {self.array.shape}", field="model.bin")
        return int(self.array.reshape(()).item())


@dataclass(frozen=True)
class Ct2Model:
    binary_version: int
    spec: str
    revision: int
    variables: dict[str, Ct2Variable]
    aliases: dict[str, str]  # alias -> variable name

    def get(self, name: str) -> Ct2Variable:
        target = self.aliases.get(name, name)
        variable = self.variables.get(target)
        if variable is None:
            raise CheckpointError(f"model.bin has no variable {name!r}", field="model.bin")
        return variable


class _Cursor:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.offset = 0

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.offset + n > len(self.data):
            raise CheckpointError(
                f"model.bin truncated: {what} needs {n} bytes at offset {self.offset}, file has {len(self.data)}",
                field="model.bin",
            )
        view = memoryview(self.data)[self.offset : self.offset + n]
        self.offset += n
        return view

    def u(self, fmt: str, what: str) -> int:
        size = struct.calcsize("<" + fmt)
        return int(struct.unpack("<" + fmt, self.take(size, what))[0])

    def string(self, what: str) -> str:
        length = self.u("H", what)
        if length == 0:
            raise CheckpointError(f"model.bin: empty string length for {what}", field="model.bin")
        raw = bytes(self.take(length, what))
        if raw[-1] != 0:
            raise CheckpointError(f"model.bin: {what} is not NUL-terminated", field="model.bin")
        try:
            return raw[:-1].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CheckpointError(f"model.bin: {what} is not UTF-8", field="model.bin") from exc


def read_ct2(path: str | Path) -> Ct2Model:
    """Parse a CTranslate2 model.bin; arrays are views of the file's bytes (no copies)."""
    data = Path(path).read_bytes()
    cur = _Cursor(data)
    version = cur.u("I", "binary version")
    if version not in SUPPORTED_VERSIONS:
        raise CheckpointError(
            f"model.bin binary version {version} not supported ({SUPPORTED_VERSIONS.start}.."
            f"{SUPPORTED_VERSIONS.stop - 1})",
            field="model.bin",
        )
    spec = cur.string("spec name")
    revision = cur.u("I", "spec revision")
    count = cur.u("I", "variable count")
    variables: dict[str, Ct2Variable] = {}
    for index in range(count):
        name = cur.string(f"variable {index} name")
        rank = cur.u("B", f"{name} rank")
        if rank > _MAX_RANK:
            raise CheckpointError(f"model.bin: {name} has rank {rank}", field="model.bin")
        shape = tuple(cur.u("I", f"{name} dimension") for _ in range(rank))
        if version >= 4:
            type_id = cur.u("B", f"{name} type")
            if type_id >= len(_DTYPES):
                raise CheckpointError(f"model.bin: {name} has unknown type id {type_id}", field="model.bin")
            nbytes = cur.u("I", f"{name} byte count")
        else:
            item_size = cur.u("B", f"{name} item size")
            if item_size not in _BY_ITEM_SIZE:
                raise CheckpointError(f"model.bin: {name} has item size {item_size}", field="model.bin")
            type_id = _BY_ITEM_SIZE[item_size]
            nbytes = cur.u("I", f"{name} element count") * item_size
        dtype = _DTYPES[type_id]
        elements = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if elements * dtype.itemsize != nbytes:
            raise CheckpointError(
                f"model.bin: {name} shape {shape} x {dtype} does not match its {nbytes} bytes", field="model.bin"
            )
        payload = cur.take(nbytes, name)
        if name in variables:
            raise CheckpointError(f"model.bin: variable {name} appears twice", field="model.bin")
        variables[name] = Ct2Variable(name, np.frombuffer(payload, dtype=dtype).reshape(shape), type_id)
    aliases: dict[str, str] = {}
    if version >= 3:
        for index in range(cur.u("I", "alias count")):
            alias = cur.string(f"alias {index}")
            target = cur.string(f"alias {index} target")
            if target not in variables:
                raise CheckpointError(f"model.bin: alias {alias} names unknown {target}", field="model.bin")
            aliases[alias] = target
    if cur.offset != len(data):
        raise CheckpointError(f"model.bin: {len(data) - cur.offset} trailing bytes", field="model.bin")
    return Ct2Model(version, spec, revision, variables, aliases)
