from __future__ import annotations

import dataclasses
import json
import struct
import zlib
from typing import Any

import pytest
import torch

from libs.cache.entry import CacheEntry, EntryError, EntryFault, check_entry, decode, encode
from libs.cache.keys import CacheKey
from libs.model.types import Modality
from tests.support.cache import NS, SPECS, make_entry, specs_for

pytestmark = pytest.mark.unit

PREFIX = struct.Struct("<4sHHIQI")


def split(blob: bytes) -> tuple[tuple[Any, ...], dict[str, Any], bytes]:
    prefix = PREFIX.unpack_from(blob)
    header_len = prefix[3]
    header = json.loads(blob[PREFIX.size : PREFIX.size + header_len])
    return prefix, header, blob[PREFIX.size + header_len :]


def reframe(header: dict[str, Any], payload: bytes, *, magic: bytes = b"EPDC", version: int = 1) -> bytes:
    """A well-framed entry (correct lengths and CRC) around any header: only the content is wrong."""
    raw = json.dumps(header).encode()
    crc = zlib.crc32(raw + payload)
    return PREFIX.pack(magic, version, 0, len(raw), len(payload), crc) + raw + payload


def fault_of(blob: bytes, key: CacheKey, **kwargs: Any) -> EntryFault:
    with pytest.raises(EntryError) as info:
        decode(blob, key=key, **kwargs)
    return info.value.fault


@pytest.mark.parametrize("modality", list(Modality))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_every_modality(modality: Modality, dtype: torch.dtype) -> None:
    key, entry = make_entry(b"media", modality, dtype=dtype)
    specs = specs_for("bfloat16" if dtype == torch.bfloat16 else "float32")
    decoded = decode(encode(entry), key=key, specs=specs)
    assert decoded.layout == entry.layout
    assert decoded.namespace == NS
    assert set(decoded.tensors) == set(entry.tensors)
    for name, tensor in entry.tensors.items():
        assert decoded.tensors[name].dtype == dtype
        assert torch.equal(decoded.tensors[name], tensor)
    # Decoded tensors own writable memory (no warning-prone views of immutable bytes).
    decoded.tensors["embeddings"].add_(0)


def test_round_trip_of_a_speech_window() -> None:
    """Contract 1.4: a Whisper window (encoder states cross-attended to, no placeholder tokens,
    window frames) comes back as written; an entry written before these fields reads as 0."""
    key, entry = make_entry(b"speech", Modality.AUDIO, rows=6)
    audio = dataclasses.replace(entry.layout.audio, window_start_frame=2948, window_frames=1202, clip_frames=4150)
    entry = dataclasses.replace(
        entry, layout=dataclasses.replace(entry.layout, audio=audio, placeholder_token_count=0, cross_attention_rows=6)
    )
    decoded = decode(encode(entry), key=key, specs=specs_for("float32"))
    assert decoded.layout == entry.layout
    _, plain = make_entry(b"media", Modality.AUDIO)
    _, header, payload = split(encode(plain))
    del header["layout"]["cross_attention_rows"]
    assert decode(reframe(header, payload), key=CacheKey(NS, plain.layout.mm_hash)).layout == plain.layout


def test_to_item_rewrites_only_the_item_index() -> None:
    _, entry = make_entry()
    item = entry.to_item(3)
    assert item.layout.item_index == 3
    assert dataclasses.replace(item.layout, item_index=0) == entry.layout
    assert item.embeddings is entry.tensors["embeddings"]


def test_empty_and_truncated_blobs() -> None:
    key, entry = make_entry()
    blob = encode(entry)
    assert fault_of(b"", key) is EntryFault.TRUNCATED
    assert fault_of(blob[:10], key) is EntryFault.TRUNCATED
    assert fault_of(blob[:-1], key) is EntryFault.TRUNCATED
    assert fault_of(blob + b"\0", key) is EntryFault.TRUNCATED


def test_magic_version_and_checksum() -> None:
    key, entry = make_entry()
    _, header, payload = split(encode(entry))
    assert fault_of(reframe(header, payload, magic=b"PKL\x80"), key) is EntryFault.BAD_MAGIC
    assert fault_of(reframe(header, payload, version=2), key) is EntryFault.UNSUPPORTED_VERSION
    flipped = bytearray(encode(entry))
    flipped[-1] ^= 0x01  # one bit of one embedding value
    assert fault_of(bytes(flipped), key) is EntryFault.CHECKSUM


def test_malformed_header() -> None:
    key, entry = make_entry()
    _, header, payload = split(encode(entry))
    raw = b"not json"
    blob = PREFIX.pack(b"EPDC", 1, 0, len(raw), len(payload), zlib.crc32(raw + payload)) + raw + payload
    assert fault_of(blob, key) is EntryFault.MALFORMED_HEADER
    assert fault_of(reframe({**header, "namespace": {"model_id": "x"}}, payload), key) is EntryFault.MALFORMED_HEADER


@pytest.mark.parametrize("field", ["model_id", "revision", "weights_digest", "dtype", "contract"])
def test_poisoned_entry_with_another_identity_is_never_served(field: str) -> None:
    key, _ = make_entry()
    # Same item, same shapes, valid framing and checksum: only the model identity differs.
    _, poisoned = make_entry(namespace=dataclasses.replace(NS, **{field: "other"}))
    assert fault_of(encode(poisoned), key, specs=SPECS) is EntryFault.NAMESPACE_MISMATCH


def test_entry_under_the_wrong_key() -> None:
    key, _ = make_entry(b"one")
    _, other = make_entry(b"two")
    assert fault_of(encode(other), key) is EntryFault.KEY_MISMATCH
    _, header, payload = split(encode(other))
    header["mm_hash"] = key.mm_hash  # header claims the key, layout still names the other item
    assert fault_of(reframe(header, payload), key) is EntryFault.KEY_MISMATCH


def test_invalid_layout() -> None:
    key, entry = make_entry()
    _, header, payload = split(encode(entry))
    header["layout"]["modality"] = "video"  # image arm under a video modality
    assert fault_of(reframe(header, payload), key) is EntryFault.LAYOUT_INVALID
    header["layout"]["modality"] = "smell"
    assert fault_of(reframe(header, payload), key) is EntryFault.LAYOUT_INVALID


@pytest.mark.parametrize(
    "change",
    [
        {"dtype": "pyobject"},
        {"shape": [4, 17]},  # nbytes no longer matches the shape
        {"nbytes": 4},
        {"offset": 8},
        {"shape": [-4, -16]},
    ],
)
def test_tensor_table_must_describe_the_payload(change: dict[str, Any]) -> None:
    key, entry = make_entry()
    _, header, payload = split(encode(entry))
    header["tensors"][0].update(change)
    assert fault_of(reframe(header, payload), key) is EntryFault.TENSOR_INVALID


def test_payload_longer_than_the_tensors() -> None:
    key, entry = make_entry()
    _, header, payload = split(encode(entry))
    assert fault_of(reframe(header, payload + b"\0" * 8), key) is EntryFault.TENSOR_INVALID
    header["tensors"].append(dict(header["tensors"][0]))  # duplicate name
    assert fault_of(reframe(header, payload * 2), key) is EntryFault.TENSOR_INVALID


def test_shape_or_spec_mismatch_is_never_served() -> None:
    key, _ = make_entry(rows=4)
    # Rows disagree with the layout's placeholder count.
    _, short = make_entry(rows=4)
    short = dataclasses.replace(short, tensors={"embeddings": short.tensors["embeddings"][:3]})
    assert fault_of(encode(short), key) is EntryFault.SPEC_MISMATCH
    # Width or dtype disagree with the encoder's measured spec.
    _, wide = make_entry(width=32)
    assert fault_of(encode(wide), key, specs=SPECS) is EntryFault.SPEC_MISMATCH
    _, half = make_entry(dtype=torch.float16)
    assert fault_of(encode(half), key, specs=SPECS) is EntryFault.SPEC_MISMATCH
    # A video entry missing its deepstack tensor.
    vkey, video = make_entry(modality=Modality.VIDEO)
    bare = dataclasses.replace(video, tensors={"embeddings": video.tensors["embeddings"]})
    assert fault_of(encode(bare), vkey, specs=SPECS) is EntryFault.SPEC_MISMATCH
    # Without specs the same bare video entry is structurally fine.
    assert decode(encode(bare), key=vkey).tensors.keys() == {"embeddings"}


def test_check_entry_guards_what_gets_cached() -> None:
    key, entry = make_entry()
    check_entry(entry, key=key, specs=SPECS)  # a sound entry under its own key passes

    def fault(candidate: CacheEntry, under: CacheKey = key) -> EntryFault:
        with pytest.raises(EntryError) as info:
            check_entry(candidate, key=under, specs=SPECS)
        return info.value.fault

    assert fault(entry, make_entry(b"other")[0]) is EntryFault.KEY_MISMATCH
    assert fault(make_entry(namespace=dataclasses.replace(NS, revision="r2"))[1]) is EntryFault.NAMESPACE_MISMATCH
    no_grid = dataclasses.replace(entry.layout, image=None, audio=None, video=None)
    assert fault(CacheEntry(NS, no_grid, entry.tensors)) is EntryFault.LAYOUT_INVALID
    assert fault(make_entry(width=32)[1]) is EntryFault.SPEC_MISMATCH
