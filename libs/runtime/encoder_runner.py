"""EncoderRunner: media items → embeddings + layout, one forward per modality per call."""

from __future__ import annotations

import hashlib
import json
import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

import torch

from libs.runtime.checkpoint import Checkpoint, load_into
from libs.runtime.dtypes import dtype_name
from libs.runtime.errors import EmbeddingMismatchError, UnsupportedModalityError
from libs.runtime.families import adapter_for
from libs.runtime.families.base import PreparedItem
from libs.runtime.media.limits import MediaLimits
from libs.runtime.types import EmbeddingSpec, EncodedItem, ExtraTensorSpec, MediaInput, Modality

# Bump when the project's preprocessing changes what an item turns into (cached outputs of the old
# code must not be served): 2 = transformers-processor parity (docs/runtime.md, "Preprocessing").
PREPROCESSING_VERSION = 2
# The files the family processors read their settings from (transformers' resolution order).
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json")


def preprocessing_digest(checkpoint: Checkpoint) -> str:
    """What, besides an item's bytes and options and the weights, fixes its tower inputs: the
    preprocessing version, the checkpoint's processor config files, and the transformers version
    (its `smart_resize`s and Whisper feature extractor run here)."""
    import transformers

    digest = hashlib.sha256(f"epd-preprocessing/{PREPROCESSING_VERSION}/{transformers.__version__}".encode())
    for name in PROCESSOR_FILES:
        file = checkpoint.path / name
        digest.update(name.encode() + b"\0" + (file.read_bytes() if file.is_file() else b"-") + b"\0")
    return digest.hexdigest()


def media_hash(media: MediaInput) -> str:
    """Hex SHA-256 of the modality, the processor options and the bytes (the encoder-cache key)."""
    digest = hashlib.sha256()
    digest.update(media.modality.value.encode())
    options: dict[str, object] = asdict(media.options)
    if media.audio_window_start_frame:  # a later window of a long clip (Whisper): its own item
        options["audio_window_start_frame"] = media.audio_window_start_frame
    digest.update(json.dumps(options, sort_keys=True).encode())
    digest.update(media.data)
    return digest.hexdigest()


class EncoderRunner:
    """Loads only the encoder towers of a checkpoint and encodes batches of media items."""

    def __init__(
        self, model_path: str | Path, *, limits: MediaLimits | None = None, dtype: torch.dtype = torch.float32
    ) -> None:
        self.checkpoint = Checkpoint(model_path)
        self.adapter = adapter_for(self.checkpoint)
        self.limits = limits or MediaLimits()
        self.dtype = dtype
        tensors = self.checkpoint.load(self.adapter.encoder_tensor_name)
        self.module = self.adapter.build_encoder()
        load_into(self.module, tensors, "encoder")
        self.module.to(dtype).eval()
        self.weights_digest = self.checkpoint.weights_digest()
        self.preprocessing_digest = preprocessing_digest(self.checkpoint)
        self.specs = {m: self._measure_spec(m) for m in sorted(self.adapter.modalities, key=lambda m: m.value)}

    @property
    def modalities(self) -> frozenset[Modality]:
        return self.adapter.modalities

    def _measure_spec(self, modality: Modality) -> EmbeddingSpec:
        (item,) = self.encode([self.adapter.dummy_media(modality)])
        extras = tuple(
            ExtraTensorSpec(name, int(t.shape[1]), dtype_name(t.dtype))
            for name, t in item.tensors.items()
            if name != "embeddings"
        )
        return EmbeddingSpec(modality, int(item.embeddings.shape[1]), dtype_name(item.embeddings.dtype), extras)

    def encode(self, items: list[MediaInput], timings: dict[str, int] | None = None) -> list[EncodedItem]:
        """Encode items (any mix of modalities); results in input order. Items of one modality go
        through their tower in a single forward. `timings`, when given, receives wall-clock
        instants (ns since the epoch) `start`, `preprocessed` and `end`, for tracing."""
        if timings is not None:
            timings["start"] = time.time_ns()
        for i, media in enumerate(items):
            if media.modality not in self.adapter.modalities:
                raise UnsupportedModalityError(
                    f"model has no {media.modality.value} encoder", field=f"items[{i}].media.modality"
                )
        prepared = [self.adapter.preprocess(m, media_hash(m), self.limits) for m in items]
        if timings is not None:
            timings["preprocessed"] = time.time_ns()
        by_modality: dict[Modality, list[int]] = defaultdict(list)
        for i, item in enumerate(prepared):
            by_modality[item.layout.modality].append(i)
        results: dict[int, EncodedItem] = {}
        with torch.inference_mode():
            for modality, indices in by_modality.items():
                batch: list[PreparedItem] = [prepared[i] for i in indices]
                outputs = self.adapter.encode(self.module, modality, batch)
                for i, tensors in zip(indices, outputs, strict=True):
                    rows = tensors["embeddings"].shape[0]
                    if rows != prepared[i].layout.rows:
                        raise EmbeddingMismatchError(f"item {i}: {rows} rows, layout says otherwise")
                    results[i] = EncodedItem(prepared[i].layout, {k: v.clone() for k, v in tensors.items()})
        if timings is not None:
            timings["end"] = time.time_ns()
        return [results[i] for i in range(len(items))]
