"""Cache keys: what an encoder output is a function of.

An entry is identified by the item's content hash (modality + processor options + bytes, `libs.model.content`,
the engines' digest too) inside a namespace that pins everything else the output depends
on: the model (id, revision, encoder weights digest), the dtype, the contract major.minor and the
preprocessing (the encoder's `preprocessing_digest`: its algorithm version, the checkpoint's
processor config files and the transformers version whose helpers it calls).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Literal

from libs.contract.epd.v1 import media_pb2
from libs.contract.version import CONTRACT_MAJOR, CONTRACT_MINOR
from libs.model import content
from libs.model.types import Modality, ProcessorOptions

# Capability of encoders that honor `EncodeRequest.cache_policy` = CACHE_POLICY_CACHED_ONLY (1.2).
CACHED_ONLY = "encoder.cached_only"
ENTRY_FORMAT_VERSION = 1  # bump when the entry layout changes; part of the store key
KEY_PREFIX = f"epd/enc/v{ENTRY_FORMAT_VERSION}"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class Namespace:
    """Everything besides the item that changes the encoder output."""

    model_id: str
    revision: str
    weights_digest: str
    dtype: str
    contract: str = f"{CONTRACT_MAJOR}.{CONTRACT_MINOR}"
    # Same bytes and options give other tower inputs under another preprocessing (its code or the
    # checkpoint's processor configs), so entries of one are never served for the other.
    preprocessing: str = "unversioned"

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not value:
                raise ValueError(f"namespace field {name} must be non-empty")

    @cached_property  # computed once: every cache lookup and publish names its store key
    def token(self) -> str:
        """A short stable digest of the namespace, used inside store keys."""
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:32]

    @cached_property
    def key_prefix(self) -> str:
        """Prefix of every store key in this namespace (advertised in `EncoderCacheInfo.key_prefix`)."""
        return f"{KEY_PREFIX}/{self.token}"

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


# The wire's ProcessorOptions fields that change the output, as named in the engine's ProcessorOptions.
OptionField = Literal["min_pixels", "max_pixels", "video_fps", "video_max_frames"]
OPTION_FIELDS: tuple[OptionField, ...] = ("min_pixels", "max_pixels", "video_fps", "video_max_frames")


def wire_content_hash(item: media_pb2.MediaItem, data: bytes) -> str:
    """The content hash (`libs.model.content`) of a wire media item whose source resolved to `data`
    (what the router computes to find an item in the store before any encoder sees it)."""
    opts = item.processor_options
    options: dict[str, object] = {name: getattr(opts, name) if opts.HasField(name) else None for name in OPTION_FIELDS}
    if opts.audio_window_start_frame:  # contract 1.4: a later window of a long clip is its own item,
        options["audio_window_start_frame"] = opts.audio_window_start_frame  # as the engine hashes it
    modality = media_pb2.Modality.Name(item.modality).removeprefix("MODALITY_").lower()
    return content.digest(modality, options, data)


def client_id_hash(modality: Modality, options: ProcessorOptions, client_id: str) -> str:
    """Hash for an item a client names by its own id instead of bytes.

    The id is never a key by itself: the options are always folded in (two requests for the same id
    with different `max_pixels` produce different outputs) and a domain tag keeps ids from colliding
    with content hashes.
    """
    if not client_id:
        raise ValueError("client_id must be non-empty")
    digest = hashlib.sha256(b"epd.client-id\0")
    digest.update(modality.value.encode() + b"\0")
    digest.update(content.options_json(options.as_dict()) + b"\0")
    digest.update(client_id.encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class CacheKey:
    namespace: Namespace
    mm_hash: str  # 64 lowercase hex digits

    def __post_init__(self) -> None:
        if not _HEX64.match(self.mm_hash):
            raise ValueError(f"mm_hash must be 64 lowercase hex digits, got {self.mm_hash!r}")

    @property
    def store_key(self) -> str:
        """The Mooncake Store object key."""
        return f"{self.namespace.key_prefix}/{self.mm_hash}"

    def __str__(self) -> str:
        return self.store_key
