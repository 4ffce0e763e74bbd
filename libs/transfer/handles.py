"""Conversions between torch tensors, pool memory and the epd.v1 `TensorHandle` contract.

Pure functions, used by the producer (building specs, descriptors, checksums, expiry) and by the
consumer (validating a handle it received, checking it against what it expects, viewing pool bytes
as tensors without a copy). Validation reuses the contract's `validate_tensor_handle` and reports
its findings as `BadDescriptor` naming the field.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from google.protobuf import timestamp_pb2
from zlib_ng.zlib_ng import crc32 as _crc32  # zlib's CRC-32, SIMD-accelerated

from libs.contract.epd.v1 import tensor_pb2
from libs.contract.errors import InvalidArgument
from libs.contract.validation import DEFAULT_LIMITS, DTYPE_SIZES, Limits, validate_tensor_handle
from libs.transfer.errors import BadDescriptor, ChecksumMismatch, SpecMismatch
from libs.transfer.pool import align_up

TORCH_DTYPES: dict[int, torch.dtype] = {
    tensor_pb2.D_TYPE_FLOAT32: torch.float32,
    tensor_pb2.D_TYPE_FLOAT16: torch.float16,
    tensor_pb2.D_TYPE_BFLOAT16: torch.bfloat16,
    tensor_pb2.D_TYPE_INT64: torch.int64,
    tensor_pb2.D_TYPE_INT32: torch.int32,
    tensor_pb2.D_TYPE_INT8: torch.int8,
    tensor_pb2.D_TYPE_UINT8: torch.uint8,
    tensor_pb2.D_TYPE_BOOL: torch.bool,
}
_DTYPE_OF_TORCH = {torch_dtype: dtype for dtype, torch_dtype in TORCH_DTYPES.items()}


@dataclasses.dataclass(frozen=True)
class ExpectedTensor:
    """What a consumer requires of one named tensor. A `None` dimension matches any size
    (e.g. `(None, 1280)` for embeddings whose token count varies per item)."""

    dtype: int
    shape: tuple[int | None, ...]


def dtype_of(torch_dtype: torch.dtype) -> int:
    """The contract DType of a torch dtype; `SpecMismatch` for dtypes the contract lacks."""
    try:
        return _DTYPE_OF_TORCH[torch_dtype]
    except KeyError:
        raise SpecMismatch(f"dtype {torch_dtype} has no epd.v1 DType") from None


def make_spec(shape: Sequence[int], torch_dtype: torch.dtype) -> tensor_pb2.TensorSpec:
    dtype = dtype_of(torch_dtype)
    return tensor_pb2.TensorSpec(
        shape=list(shape),
        dtype=dtype,  # type: ignore[arg-type]
        nbytes=math.prod(shape) * DTYPE_SIZES[dtype],
        layout=tensor_pb2.TENSOR_LAYOUT_ROW_MAJOR,
    )


def packed_offsets(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Offsets of tensors packed one after another in a slot (each aligned), and the total size."""
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += align_up(size)
    return offsets, total


def crc32(data: Any) -> tensor_pb2.Checksum:
    return tensor_pb2.Checksum(algorithm=tensor_pb2.CHECKSUM_ALGORITHM_CRC32, value=_crc32(data))


def verify_checksum(name: str, checksum: tensor_pb2.Checksum, data: Any) -> None:
    if checksum.algorithm != tensor_pb2.CHECKSUM_ALGORITHM_CRC32:
        return
    actual = _crc32(data)
    if actual != checksum.value:
        raise ChecksumMismatch(
            f"tensor {name!r}: CRC32 of the bytes read is {actual:#010x}, the producer's is {checksum.value:#010x}"
        )


def expiry_timestamp(ttl_s: float) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(time.time_ns() + int(ttl_s * 1e9))
    return stamp


def seconds_left(stamp: timestamp_pb2.Timestamp) -> float:
    """Seconds until `stamp` by our wall clock (negative once past)."""
    return (stamp.ToNanoseconds() - time.time_ns()) / 1e9


def validate_handle(handle: tensor_pb2.TensorHandle, limits: Limits = DEFAULT_LIMITS) -> None:
    """The contract's self-consistency rules, plus what this transport supports (host memory)."""
    try:
        validate_tensor_handle(handle, "handle", limits)
    except InvalidArgument as exc:
        raise BadDescriptor(exc.message, field=exc.field) from exc
    for i, desc in enumerate(handle.tensors):
        if desc.spec.layout != tensor_pb2.TENSOR_LAYOUT_ROW_MAJOR:
            raise SpecMismatch(f"handle.tensors[{i}].spec.layout: only ROW_MAJOR is supported")
        for j, region in enumerate(desc.regions):
            if region.memory_kind != tensor_pb2.MEMORY_KIND_CPU:
                raise SpecMismatch(
                    f"handle.tensors[{i}].regions[{j}].memory_kind: "
                    f"{tensor_pb2.MemoryKind.Name(region.memory_kind)} is not supported; this transport "
                    "moves host memory only"
                )


def check_expected(handle: tensor_pb2.TensorHandle, expected: Mapping[str, ExpectedTensor]) -> None:
    """`SpecMismatch` unless the handle holds exactly the expected tensors, with matching specs."""
    names = [desc.name for desc in handle.tensors]
    if set(names) != set(expected):
        raise SpecMismatch(f"handle holds tensors {sorted(names)}; expected {sorted(expected)}")
    for desc in handle.tensors:
        want = expected[desc.name]
        shape = tuple(desc.spec.shape)
        shape_ok = len(shape) == len(want.shape) and all(
            w is None or w == s for s, w in zip(shape, want.shape, strict=True)
        )
        if desc.spec.dtype != want.dtype or not shape_ok:
            raise SpecMismatch(
                f"tensor {desc.name!r} is {tensor_pb2.DType.Name(desc.spec.dtype)}{list(shape)}; expected "
                f"{tensor_pb2.DType.Name(want.dtype)}{['*' if w is None else w for w in want.shape]}"  # type: ignore[arg-type]
            )


def view_tensor(buffer: Any, offset: int, spec: tensor_pb2.TensorSpec) -> torch.Tensor:
    """A tensor over `buffer[offset:]` with `spec`'s dtype and shape, sharing the memory."""
    shape = tuple(spec.shape)
    numel = math.prod(shape)
    torch_dtype = TORCH_DTYPES[spec.dtype]
    if numel == 0:
        return torch.empty(shape, dtype=torch_dtype)
    flat = torch.frombuffer(buffer, dtype=torch_dtype, count=numel, offset=offset)
    return flat if len(shape) == 1 else flat.view(shape)
