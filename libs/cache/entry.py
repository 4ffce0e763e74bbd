"""Self-describing serialized cache entries, and the strict decoder that guards their use.

Layout (little-endian):

    prefix  24 bytes: magic "EPDC", format version u16, flags u16 (0), header length u32,
            payload length u64, CRC-32 of header + payload u32
    header  UTF-8 JSON: namespace, mm_hash, layout (ItemLayout fields), tensors (name, dtype,
            shape, nbytes, offset into the payload)
    payload the raw tensor bytes, back to back in header order

No pickle anywhere: a stored entry is data, never code. Anything that does not check out raises
`EntryError`; callers treat it as a miss and never serve the entry.
"""

from __future__ import annotations

import enum
import json
import math
import struct
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from zlib_ng.zlib_ng import crc32  # zlib's CRC-32, SIMD-accelerated

from libs.cache.keys import ENTRY_FORMAT_VERSION, CacheKey, Namespace
from libs.model.dtypes import DTYPE_BY_NAME, NAME_BY_DTYPE, dtype_name
from libs.model.types import AudioLayout, EmbeddingSpec, EncodedItem, ImageLayout, ItemLayout, Modality, VideoLayout

MAGIC = b"EPDC"
_PREFIX = struct.Struct("<4sHHIQI")
MAX_HEADER_BYTES = 1 << 20


class EntryFault(enum.Enum):
    TRUNCATED = "truncated"
    BAD_MAGIC = "bad_magic"
    UNSUPPORTED_VERSION = "unsupported_version"
    CHECKSUM = "checksum"
    MALFORMED_HEADER = "malformed_header"
    NAMESPACE_MISMATCH = "namespace_mismatch"
    KEY_MISMATCH = "key_mismatch"
    LAYOUT_INVALID = "layout_invalid"
    TENSOR_INVALID = "tensor_invalid"
    SPEC_MISMATCH = "spec_mismatch"


class EntryError(Exception):
    """A stored entry that must not be served; `fault` says why (a metric label)."""

    def __init__(self, fault: EntryFault, detail: str) -> None:
        super().__init__(f"{fault.value}: {detail}")
        self.fault = fault
        self.detail = detail


@dataclass(frozen=True)
class CacheEntry:
    """One encoded item under a namespace. Tensors are shared with the cache: treat them as read-only."""

    namespace: Namespace
    layout: ItemLayout
    tensors: dict[str, torch.Tensor]

    @property
    def mm_hash(self) -> str:
        return self.layout.mm_hash

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @classmethod
    def from_item(cls, namespace: Namespace, item: EncodedItem) -> CacheEntry:
        return cls(namespace, item.layout, dict(item.tensors))

    def to_item(self, item_index: int) -> EncodedItem:
        """The entry as the encoder's output for item `item_index` of the current request."""
        return EncodedItem(replace(self.layout, item_index=item_index), dict(self.tensors))


def _layout_to_json(layout: ItemLayout) -> dict[str, Any]:
    raw = asdict(layout)
    raw["modality"] = layout.modality.value
    return raw


def _layout_from_json(raw: Any) -> ItemLayout:
    try:
        video = raw.get("video")
        if video is not None:
            video = VideoLayout(**{**video, "grid_timestamps_s": tuple(video["grid_timestamps_s"])})
        image = raw.get("image")
        audio = raw.get("audio")
        layout = ItemLayout(
            modality=Modality(raw["modality"]),
            item_index=int(raw["item_index"]),
            mm_hash=str(raw["mm_hash"]),
            placeholder_token_count=int(raw["placeholder_token_count"]),
            image=ImageLayout(**image) if image is not None else None,
            video=video,
            audio=AudioLayout(**audio) if audio is not None else None,
            # Entries written before encoder-decoder items existed have no such key.
            cross_attention_rows=int(raw.get("cross_attention_rows", 0)),
        )
        layout.check()
    except Exception as exc:  # any malformed layout is the same fault
        raise EntryError(EntryFault.LAYOUT_INVALID, str(exc)) from exc
    return layout


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    data: memoryview = flat.view(torch.uint8).numpy().data
    return data


def encode(entry: CacheEntry) -> bytes:
    """Serialize an entry (header + raw tensor bytes)."""
    entry.layout.check()
    parts: list[memoryview] = []
    specs = []
    offset = 0
    for name, tensor in entry.tensors.items():
        if tensor.dtype not in NAME_BY_DTYPE:
            raise ValueError(f"tensor {name}: unsupported dtype {tensor.dtype}")
        data = _tensor_bytes(tensor)
        specs.append(
            {
                "name": name,
                "dtype": dtype_name(tensor.dtype),
                "shape": list(tensor.shape),
                "nbytes": data.nbytes,
                "offset": offset,
            }
        )
        parts.append(data)
        offset += data.nbytes
    header = json.dumps(
        {
            "namespace": entry.namespace.as_dict(),
            "mm_hash": entry.mm_hash,
            "layout": _layout_to_json(entry.layout),
            "tensors": specs,
        },
        sort_keys=True,
    ).encode()
    crc = crc32(header)
    for part in parts:
        crc = crc32(part, crc)
    prefix = _PREFIX.pack(MAGIC, ENTRY_FORMAT_VERSION, 0, len(header), offset, crc)
    return b"".join([prefix, header, *parts])


def _split(blob: bytes | bytearray | memoryview) -> tuple[dict[str, Any], memoryview]:
    view = memoryview(blob)
    if view.nbytes < _PREFIX.size:
        raise EntryError(EntryFault.TRUNCATED, f"{view.nbytes} bytes, prefix needs {_PREFIX.size}")
    magic, version, _flags, header_len, payload_len, crc = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise EntryError(EntryFault.BAD_MAGIC, repr(bytes(magic)))
    if version != ENTRY_FORMAT_VERSION:
        raise EntryError(EntryFault.UNSUPPORTED_VERSION, f"format {version}, expected {ENTRY_FORMAT_VERSION}")
    if header_len > MAX_HEADER_BYTES or _PREFIX.size + header_len + payload_len != view.nbytes:
        raise EntryError(
            EntryFault.TRUNCATED, f"{view.nbytes} bytes, header {header_len} + payload {payload_len} say otherwise"
        )
    body = view[_PREFIX.size :]
    if crc32(body) != crc:
        raise EntryError(EntryFault.CHECKSUM, "CRC-32 of header and payload does not match")
    try:
        header = json.loads(bytes(body[:header_len]))
        if not isinstance(header, dict):
            raise TypeError("header is not an object")
    except (ValueError, TypeError) as exc:
        raise EntryError(EntryFault.MALFORMED_HEADER, str(exc)) from exc
    return header, body[header_len:]


def _tensors(raw: Any, payload: memoryview) -> dict[str, torch.Tensor]:
    if not isinstance(raw, list) or not raw:
        raise EntryError(EntryFault.TENSOR_INVALID, "no tensor list")
    # One copy into writable memory; the tensors then view it without further copies.
    storage = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload.nbytes else None
    tensors: dict[str, torch.Tensor] = {}
    expected_offset = 0
    for spec in raw:
        try:
            name, dtype_str, nbytes, offset = spec["name"], spec["dtype"], spec["nbytes"], spec["offset"]
            shape = [int(d) for d in spec["shape"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise EntryError(EntryFault.TENSOR_INVALID, f"bad tensor spec {spec!r}") from exc
        dtype = DTYPE_BY_NAME.get(dtype_str)
        if dtype is None or not isinstance(name, str) or name in tensors:
            raise EntryError(EntryFault.TENSOR_INVALID, f"tensor {name!r}: bad name or dtype {dtype_str!r}")
        if any(d < 0 for d in shape):
            raise EntryError(EntryFault.TENSOR_INVALID, f"tensor {name}: negative dimension in {shape}")
        itemsize = torch.empty((), dtype=dtype).element_size()
        if nbytes != math.prod(shape) * itemsize or offset != expected_offset:
            raise EntryError(EntryFault.TENSOR_INVALID, f"tensor {name}: {shape} {dtype_str} != {nbytes} bytes")
        expected_offset += nbytes
        if expected_offset > payload.nbytes:
            raise EntryError(EntryFault.TENSOR_INVALID, f"tensor {name} runs past the payload")
        chunk = storage[offset : offset + nbytes] if storage is not None else torch.empty(0, dtype=torch.uint8)
        tensors[name] = chunk.view(dtype).reshape(shape)
    if expected_offset != payload.nbytes:
        raise EntryError(EntryFault.TENSOR_INVALID, f"tensors cover {expected_offset} of {payload.nbytes} bytes")
    return tensors


def _check_spec(layout: ItemLayout, tensors: dict[str, torch.Tensor], spec: EmbeddingSpec | None) -> None:
    emb = tensors.get("embeddings")
    if emb is None or emb.dim() != 2:
        raise EntryError(EntryFault.SPEC_MISMATCH, "no 2-D embeddings tensor")
    if emb.shape[0] != layout.rows:
        raise EntryError(EntryFault.SPEC_MISMATCH, f"{emb.shape[0]} rows, layout says {layout.rows}")
    if spec is None:
        return
    if spec.modality != layout.modality:
        raise EntryError(EntryFault.SPEC_MISMATCH, f"spec is for {spec.modality.value}, entry {layout.modality.value}")
    if emb.shape[1] != spec.width or dtype_name(emb.dtype) != spec.dtype:
        raise EntryError(
            EntryFault.SPEC_MISMATCH,
            f"embeddings [{emb.shape[1]}] {dtype_name(emb.dtype)}, spec [{spec.width}] {spec.dtype}",
        )
    expected = {"embeddings"} | {x.name for x in spec.extra_tensors}
    if set(tensors) != expected:
        raise EntryError(EntryFault.SPEC_MISMATCH, f"tensors {sorted(tensors)}, spec has {sorted(expected)}")
    for extra in spec.extra_tensors:
        t = tensors[extra.name]
        if t.dim() != 2 or t.shape[1] != extra.width or dtype_name(t.dtype) != extra.dtype:
            raise EntryError(EntryFault.SPEC_MISMATCH, f"{extra.name}: {list(t.shape)} {dtype_name(t.dtype)}")


def decode(
    blob: bytes | bytearray | memoryview, *, key: CacheKey, specs: Mapping[Modality, EmbeddingSpec] | None = None
) -> CacheEntry:
    """Parse and validate an entry stored under `key`; raise `EntryError` on anything unexpected.

    `specs` (the encoder's measured per-modality specs) add width/dtype/extra-tensor checks.
    """
    header, payload = _split(blob)
    raw_ns = header.get("namespace")
    try:
        namespace = Namespace(**raw_ns) if isinstance(raw_ns, dict) else None
    except (TypeError, ValueError) as exc:
        raise EntryError(EntryFault.MALFORMED_HEADER, f"namespace: {exc}") from exc
    if namespace != key.namespace:
        raise EntryError(EntryFault.NAMESPACE_MISMATCH, f"entry {raw_ns!r}, expected {key.namespace.as_dict()!r}")
    if header.get("mm_hash") != key.mm_hash:
        raise EntryError(EntryFault.KEY_MISMATCH, f"entry is for {header.get('mm_hash')!r}")
    layout = _layout_from_json(header.get("layout"))
    if layout.mm_hash != key.mm_hash:
        raise EntryError(EntryFault.KEY_MISMATCH, f"layout is for {layout.mm_hash!r}")
    tensors = _tensors(header.get("tensors"), payload)
    _check_spec(layout, tensors, (specs or {}).get(layout.modality))
    return CacheEntry(namespace, layout, tensors)


def check_entry(entry: CacheEntry, *, key: CacheKey, specs: Mapping[Modality, EmbeddingSpec] | None = None) -> None:
    """The same namespace/key/spec checks `decode` applies, for an in-memory entry about to be cached."""
    if entry.namespace != key.namespace:
        raise EntryError(EntryFault.NAMESPACE_MISMATCH, "entry namespace differs from the key's")
    if entry.mm_hash != key.mm_hash:
        raise EntryError(EntryFault.KEY_MISMATCH, f"entry is for {entry.mm_hash!r}")
    try:
        entry.layout.check()
    except Exception as exc:
        raise EntryError(EntryFault.LAYOUT_INVALID, str(exc)) from exc
    _check_spec(entry.layout, entry.tensors, (specs or {}).get(entry.layout.modality))
