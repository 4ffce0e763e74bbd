"""Test-only wire format between stage processes: length-prefixed frames of a JSON header plus raw
tensor bytes (no pickle). The services use protobuf + NIXL instead; this only proves that plain
bytes carry everything a stage needs."""

from __future__ import annotations

import json
import struct
from dataclasses import asdict
from typing import Any, BinaryIO

import torch

from libs.model.dtypes import DTYPE_BY_NAME, dtype_name
from libs.model.types import AudioLayout, DecodeState, ImageLayout, ItemLayout, KvCacheLayout, Modality, VideoLayout


def pack(header: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None) -> bytes:
    tensors = tensors or {}
    specs, blobs = [], []
    for name, t in tensors.items():
        t = t.detach().contiguous()
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        specs.append({"name": name, "dtype": dtype_name(t.dtype), "shape": list(t.shape), "nbytes": len(raw)})
        blobs.append(raw)
    head = json.dumps({"header": header, "tensors": specs}).encode()
    return struct.pack("<Q", len(head)) + head + b"".join(blobs)


def unpack(data: bytes) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    (n,) = struct.unpack_from("<Q", data)
    meta = json.loads(data[8 : 8 + n])
    offset = 8 + n
    tensors = {}
    for spec in meta["tensors"]:
        raw = data[offset : offset + spec["nbytes"]]
        offset += spec["nbytes"]
        dtype = DTYPE_BY_NAME[spec["dtype"]]
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        tensors[spec["name"]] = flat.view(dtype).reshape(spec["shape"]).clone()
    return meta["header"], tensors


def write_frame(stream: BinaryIO, payload: bytes) -> None:
    stream.write(struct.pack("<Q", len(payload)) + payload)
    stream.flush()


def read_frame(stream: BinaryIO) -> bytes:
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError("peer closed the pipe")
    (n,) = struct.unpack("<Q", head)
    return stream.read(n)


def layout_to_dict(layout: ItemLayout) -> dict[str, Any]:
    d = asdict(layout)
    d["modality"] = layout.modality.value
    return d


def layout_from_dict(d: dict[str, Any]) -> ItemLayout:
    video = d.get("video")
    return ItemLayout(
        modality=Modality(d["modality"]),
        item_index=d["item_index"],
        mm_hash=d["mm_hash"],
        placeholder_token_count=d["placeholder_token_count"],
        image=ImageLayout(**d["image"]) if d.get("image") else None,
        video=VideoLayout(**{**video, "grid_timestamps_s": tuple(video["grid_timestamps_s"])}) if video else None,
        audio=AudioLayout(**d["audio"]) if d.get("audio") else None,
    )


def state_from_dict(d: dict[str, Any]) -> DecodeState:
    return DecodeState(**d)


def kv_layout_from_dict(d: dict[str, Any]) -> KvCacheLayout:
    return KvCacheLayout(**d)
