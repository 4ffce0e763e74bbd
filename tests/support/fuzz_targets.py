"""Fuzz targets: each takes raw bytes and may raise only its typed errors.

A target turns the fuzzer's bytes into one input of an EPD surface that takes outside data —
request validation for every RPC, tensor-handle checks, the media decoders and preprocessing
behind the encoder, the cache-entry parser — and calls it. Any other exception (an IndexError, a
ZeroDivisionError, a torch error...) is a bug: the service would answer INTERNAL, or worse.
`make fuzz` runs them coverage-guided under atheris (tests/fuzz/run.py); the regression test
(tests/fuzz/test_regressions.py) replays every saved input through the same functions.
"""

from __future__ import annotations

import contextlib
import functools
import struct
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import atheris
from google.protobuf import message

from libs.contract import validation
from libs.contract.epd.v1 import tensor_pb2
from libs.contract.errors import EpdError
from tests.support import samples
from tests.support.fuzz_structured import fill


@dataclass(frozen=True)
class Target:
    name: str
    run: Callable[[bytes], None]
    allowed: tuple[type[BaseException], ...]  # what the surface may raise on bad input
    seeds: Callable[[], Iterable[bytes]]


# --- request validation ---------------------------------------------------------------------

_REQUESTS: list[tuple[Callable[[], message.Message], Callable[[Any], None]]] = [
    (samples.generate_request, validation.validate_generate_request),
    (samples.encode_request, validation.validate_encode_request),
    (samples.prefill_request, validation.validate_prefill_request),
    (samples.prefill_decode_request, validation.validate_prefill_decode_request),
    (samples.decode_request, validation.validate_decode_request),
    (samples.release_leases_request, validation.validate_release_leases_request),
    (samples.get_service_info_request, validation.validate_get_service_info_request),
]


def _validation(data: bytes) -> None:
    """A valid sample request of a fuzzer-chosen type, with fuzzer-chosen fields overwritten or
    appended (so deep validators are reached), or the raw bytes parsed as that request."""
    fdp = atheris.FuzzedDataProvider(data)
    sample, validate = _REQUESTS[fdp.ConsumeIntInRange(0, len(_REQUESTS) - 1)]
    request = sample()
    if fdp.ConsumeBool():
        fill(fdp, request)
    else:
        request.Clear()
        try:
            request.ParseFromString(fdp.ConsumeBytes(fdp.remaining_bytes()))
        except message.DecodeError:
            return  # gRPC's business (INTERNAL before the handler runs)
    validate(request)


def _validation_seeds() -> Iterable[bytes]:
    for i in range(len(_REQUESTS)):
        yield bytes([i, 1]) + bytes(64)  # each type, structured, few fields touched
        yield bytes([i, 0]) + _REQUESTS[i][0]().SerializeToString()  # each type, as valid wire bytes


# --- tensor handles -------------------------------------------------------------------------


def _handle(data: bytes) -> None:
    """A handle as a consumer receives it: the contract's checks, this transport's, and the match
    against what the consumer expects (embeddings [*, 8] float32)."""
    from libs.transfer.handles import ExpectedTensor, check_expected, validate_handle

    fdp = atheris.FuzzedDataProvider(data)
    handle = samples.nixl_handle(rows=fdp.ConsumeIntInRange(1, 8))
    if fdp.ConsumeBool():
        handle.Clear()
    fill(fdp, handle)
    validate_handle(handle)
    check_expected(handle, {"embeddings": ExpectedTensor(tensor_pb2.D_TYPE_FLOAT32, (None, 8))})


def _handle_errors() -> tuple[type[BaseException], ...]:
    from libs.transfer.errors import TransferError

    return (TransferError, EpdError)


# --- media: decoders and preprocessing behind the encoder ------------------------------------


@functools.cache
def _adapter() -> Any:
    """The tiny Qwen2.5-Omni checkpoint's family adapter: images, video and audio."""
    from libs.model.checkpoint import Checkpoint
    from libs.model.checkpoints import ensure_checkpoint
    from libs.model.families import adapter_for

    return adapter_for(Checkpoint(ensure_checkpoint("qwen2_5_omni", "tiny")))


def _media(modality_name: str) -> Callable[[bytes], None]:
    def run(data: bytes) -> None:
        from libs.model.content import media_hash
        from libs.model.media.limits import MediaLimits
        from libs.model.types import MediaInput, Modality

        media = MediaInput(Modality(modality_name), data)
        _adapter().preprocess(media, media_hash(media), MediaLimits())

    return run


def _media_seeds(modality_name: str) -> Callable[[], Iterable[bytes]]:
    def seeds() -> Iterable[bytes]:
        from libs.model.media import synthetic

        if modality_name == "image":
            yield synthetic.png_bytes(28, 28, seed=1)
            yield synthetic.png_bytes(57, 13, seed=2)
        elif modality_name == "video":
            yield synthetic.video_bytes(56, 56, frames=4, fps=2, seed=1)
        else:
            yield synthetic.wav_bytes(0.5, seed=1)

    return seeds


def _engine_errors() -> tuple[type[BaseException], ...]:
    from libs.model.errors import EngineError

    return (EngineError,)


# --- cache entries --------------------------------------------------------------------------

_PREFIX = struct.Struct("<4sHHIQI")


def _cache_entry(data: bytes) -> None:
    """A stored entry as an encoder reads it back from the shared store. Half of the inputs get a
    correct prefix and CRC around fuzzer-made header and payload, so the parser behind the
    checksum is explored too."""
    from libs.cache import entry
    from libs.cache.keys import ENTRY_FORMAT_VERSION
    from tests.support.cache import SPECS, make_entry

    key, _ = make_entry()
    if data[:1] == b"\x01":
        fdp = atheris.FuzzedDataProvider(data[1:])
        header = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 4096))
        payload = fdp.ConsumeBytes(fdp.remaining_bytes())
        crc = zlib.crc32(header + payload)
        data = _PREFIX.pack(entry.MAGIC, ENTRY_FORMAT_VERSION, 0, len(header), len(payload), crc) + header + payload
    entry.decode(data, key=key, specs=SPECS)


def _cache_entry_seeds() -> Iterable[bytes]:
    from libs.cache import entry
    from tests.support.cache import make_entry

    _, valid = make_entry()
    blob = entry.encode(valid)
    yield blob
    header_len = _PREFIX.unpack_from(blob)[3]
    header, payload = blob[_PREFIX.size : _PREFIX.size + header_len], blob[_PREFIX.size + header_len :]
    # Framed form: the fuzzer's header length prefix (ConsumeIntInRange reads it) then the parts.
    yield b"\x01" + header_len.to_bytes(2, "little") + header + payload


def _entry_errors() -> tuple[type[BaseException], ...]:
    from libs.cache.entry import EntryError

    return (EntryError,)


TARGETS: dict[str, tuple[Callable[[bytes], None], Callable[[], tuple[type[BaseException], ...]], Any]] = {
    "validation": (_validation, lambda: (EpdError,), _validation_seeds),
    "handle": (_handle, _handle_errors, lambda: [bytes(8), bytes([1]) * 64]),
    "image": (_media("image"), _engine_errors, _media_seeds("image")),
    "video": (_media("video"), _engine_errors, _media_seeds("video")),
    "audio": (_media("audio"), _engine_errors, _media_seeds("audio")),
    "cache_entry": (_cache_entry, _entry_errors, _cache_entry_seeds),
}


def target(name: str) -> Target:
    run, allowed, seeds = TARGETS[name]
    return Target(name, run, allowed(), seeds)


def call(t: Target, data: bytes) -> None:
    """Run one input; typed errors are the expected answer to bad input, anything else propagates."""
    with contextlib.suppress(*t.allowed):
        t.run(data)
