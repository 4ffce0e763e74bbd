"""An item's content identity: the digest of its modality, the processor options that change its
encoder output, and its bytes. The encoder cache keys on it and the engines name items by it; it is
torch-free so that the router can hash an item before any encoder sees it."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

from libs.model.types import MediaInput, Modality, ProcessorOptions


def options_json(options: Mapping[str, object]) -> bytes:
    """The options' canonical bytes (sorted keys), as every content digest folds them in."""
    return json.dumps(dict(options), sort_keys=True).encode()


def digest(modality: str, options: Mapping[str, object], data: bytes) -> str:
    """Hex SHA-256 of a modality name, processor options and bytes."""
    sha = hashlib.sha256()
    sha.update(modality.encode())
    sha.update(options_json(options))
    sha.update(data)
    return sha.hexdigest()


def content_hash(modality: Modality, options: ProcessorOptions, data: bytes) -> str:
    return digest(modality.value, options.as_dict(), data)


def media_hash(media: MediaInput) -> str:
    """The item's content hash; a later window of a long clip (Whisper) is an item of its own."""
    options: dict[str, object] = dict(media.options.as_dict())
    if media.audio_window_start_frame:
        options["audio_window_start_frame"] = media.audio_window_start_frame
    return digest(media.modality.value, options, media.data)


def scoped(mm_hash: str, salt: str) -> str:
    """An item's identity in an engine's caches: its content hash within its tenant (`salt`), so
    equal media reuse one entry inside a tenant and never across tenants."""
    if not salt:
        return mm_hash
    return hashlib.sha256(
        b"epd.scoped\0" + salt.encode("utf-8", "surrogatepass") + b"\0" + mm_hash.encode()
    ).hexdigest()
