"""Typed engine errors. Services map `kind` onto gRPC status codes; the engine never imports gRPC."""

from __future__ import annotations

import enum


class ErrorKind(enum.Enum):
    """Which status family an error belongs to (mirrors the gRPC codes the services use)."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"


class EngineError(Exception):
    """Base of every error the engine raises on purpose. `field` names the offending input."""

    kind: ErrorKind = ErrorKind.INVALID_ARGUMENT

    def __init__(self, message: str, *, field: str = "") -> None:
        super().__init__(message)
        self.field = field


class InvalidMediaError(EngineError):
    """The media bytes could not be decoded (corrupt, truncated, not the announced kind)."""


class UnsupportedModalityError(EngineError):
    """The model has no encoder for this modality."""


class MediaLimitError(EngineError):
    """The media exceeds a configured limit (bytes, pixels, frames, seconds)."""


class InvalidRequestError(EngineError):
    """A request field is out of range or inconsistent (sampling, prompt, placeholders)."""


class EmbeddingMismatchError(EngineError):
    """Embeddings do not match their layout metadata or the advertised embedding spec."""


class KvMismatchError(EngineError):
    """A KV cache does not belong to this model (identity, shape or dtype differ)."""

    kind = ErrorKind.FAILED_PRECONDITION


class PrefixMissError(EngineError):
    """An item sent as held in the prefix cache (no embeddings) is not covered by it: the caller
    must send its embeddings."""

    kind = ErrorKind.FAILED_PRECONDITION


class CheckpointError(EngineError):
    """The checkpoint directory is unusable (missing files, unknown family, missing tensors)."""

    kind = ErrorKind.FAILED_PRECONDITION


class CapacityError(EngineError):
    """A bounded resource (decode batch slots) is full."""

    kind = ErrorKind.RESOURCE_EXHAUSTED
