"""EncoderRunner: media items → embeddings + layout, one forward per modality per call (or per
batch of calls: `encode_calls`)."""

from __future__ import annotations

import hashlib
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import torch

from libs.model.checkpoint import Checkpoint, load_into
from libs.model.content import media_hash
from libs.model.dtypes import dtype_name
from libs.model.errors import EmbeddingMismatchError, UnsupportedModalityError
from libs.model.families import adapter_for
from libs.model.families.base import PreparedItem
from libs.model.media.limits import MediaLimits
from libs.model.types import EmbeddingSpec, EncodedItem, ExtraTensorSpec, MediaInput, Modality

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


def fewest_exact_rows(module: torch.nn.Module, most: int = 32) -> int:
    """The fewest embedding rows an item may have for its outputs to keep their bits when its rows
    go through `module`'s linear layers beside other items' rows: a BLAS may multiply a product of
    a few rows with another kernel than a tall one, in another summation order, and which counts it
    does so for depends on the host, so the count is checked at start-up with the layers' own
    weights. An item has at least as many rows at
    every layer as in its embeddings (a merger's 2x2 groups come last). Checked up to `most` rows;
    `most + 1` if that many still differ (then nothing merges)."""
    layers: dict[tuple[int, int, bool, torch.dtype], torch.nn.Linear] = {}
    for layer in module.modules():
        if isinstance(layer, torch.nn.Linear):
            layers.setdefault(
                (layer.in_features, layer.out_features, layer.bias is not None, layer.weight.dtype), layer
            )
    fewest = 1
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for (width, _, _, dtype), layer in layers.items():
            rows = torch.randn(4 * most, width, generator=generator).to(dtype)
            tall = layer(rows)
            for count in range(most, fewest - 1, -1):
                if not torch.equal(layer(rows[:count]), tall[:count]):
                    fewest = count + 1
                    break
    return fewest


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
        self.fewest_exact_rows = fewest_exact_rows(self.module)

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
        prepared = self.prepare(items)
        if timings is not None:
            timings["preprocessed"] = time.time_ns()
        encoded = self.run_towers(prepared)
        if timings is not None:
            timings["end"] = time.time_ns()
        return encoded

    def encode_calls(
        self, calls: Sequence[list[MediaInput]], timings: dict[str, int] | None = None
    ) -> list[list[EncodedItem] | Exception]:
        """Several callers' items through the towers together (one forward per modality), each
        call's result (or its own error) in call order: a call whose input is bad fails alone.
        Merge only calls whose items the towers treat apart (`merges_exactly`): their outputs are
        then the same bits as encoded call by call (a call with an item of fewer rows than this
        host's `fewest_exact_rows` is encoded alone). `timings` as `encode`, for the whole batch."""
        if timings is not None:
            timings["start"] = time.time_ns()
        outcomes: list[list[PreparedItem] | Exception] = []
        for call in calls:
            try:
                outcomes.append(self.prepare(call))
            except Exception as exc:  # the caller's own error, raised in its request
                outcomes.append(exc)
        if timings is not None:
            timings["preprocessed"] = time.time_ns()
        # A call with an item too small to keep its bits beside others (`fewest_exact_rows`) runs alone.
        ready = [
            o
            for o in outcomes
            if not isinstance(o, Exception) and all(item.layout.rows >= self.fewest_exact_rows for item in o)
        ]
        merged = {id(o) for o in ready}
        flat: list[EncodedItem] | None = None
        failure: Exception | None = None
        try:
            flat = self.run_towers([item for prepared in ready for item in prepared]) if ready else None
        except Exception as exc:
            if len(ready) == 1:
                failure = exc  # that call's; with several, which call's items failed is found call by call
        results: list[list[EncodedItem] | Exception] = []
        start = 0
        for outcome in outcomes:
            if isinstance(outcome, Exception):
                results.append(outcome)
            elif flat is not None and id(outcome) in merged:
                results.append(flat[start : start + len(outcome)])
                start += len(outcome)
            elif failure is not None and id(outcome) in merged:
                results.append(failure)
            else:
                try:
                    results.append(self.run_towers(outcome))
                except Exception as exc:
                    results.append(exc)
        if timings is not None:
            timings["end"] = time.time_ns()
        return results

    @staticmethod
    def merges_exactly(items: Sequence[MediaInput]) -> bool:
        """Whether a call's items may share a forward with other calls' items and keep their bits:
        images (each its own attention sequence: measured bit-equal on the three vision families,
        tests/runtime/test_encode_calls.py); a video's or audio's output moves in its last bits
        with its batch (Qwen3-VL video, Qwen2.5-Omni audio), so those calls run alone."""
        return all(m.modality is Modality.IMAGE for m in items)

    def prepare(self, items: Sequence[MediaInput]) -> list[PreparedItem]:
        """Check and preprocess a call's items (errors name `items[i]`)."""
        for i, media in enumerate(items):
            if media.modality not in self.adapter.modalities:
                raise UnsupportedModalityError(
                    f"model has no {media.modality.value} encoder", field=f"items[{i}].media.modality"
                )
        return [self.adapter.preprocess(m, media_hash(m), self.limits) for m in items]

    def run_towers(self, prepared: list[PreparedItem]) -> list[EncodedItem]:
        """Preprocessed items through their towers, one forward per modality; results in order."""
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
        return [results[i] for i in range(len(prepared))]
