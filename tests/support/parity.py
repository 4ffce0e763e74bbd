"""One media item through the project's preprocessing and through the family's transformers
processor, compared field by field. Used by the parity tests and by `python -m tests.support.parity`,
which prints the parity table (family x modality x case)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from libs.model.content import media_hash
from libs.model.errors import EngineError, InvalidMediaError
from libs.model.families.base import FamilyAdapter, PreparedItem
from libs.model.media.limits import MediaLimits
from libs.model.prompt import build_prompt
from libs.model.types import (
    ChatMessage,
    ChatRole,
    EncodedItem,
    EncodedPart,
    MediaInput,
    Modality,
    ProcessorOptions,
    TextPart,
)
from tests.support.hf_reference import (
    RefItem,
    has_transparency,
    processor_composites_alpha,
    reference_batch,
    reference_image_raw,
)

PROMPT_TEXT = "what is in it?"


@dataclass
class Comparison:
    family: str
    modality: str
    case: str
    fields: dict[str, tuple[bool, float | None]] = field(default_factory=dict)  # name -> (equal, max abs diff)
    error: str | None = None  # both sides refused the item (the project with a typed error)
    note: str = ""  # how the reference was adjusted by a documented decision, if it was

    @property
    def equal(self) -> bool:
        return all(ok for ok, _ in self.fields.values())

    def check(self, name: str, ours: Any, ref: Any) -> None:
        if isinstance(ours, torch.Tensor):
            same_shape = tuple(ours.shape) == tuple(ref.shape)
            diff = float((ours.float() - ref.float()).abs().max()) if same_shape and ours.numel() else None
            self.fields[name] = (same_shape and torch.equal(ours, ref.to(ours.dtype)), diff)
        else:
            self.fields[name] = (ours == ref, None)


def project_item(adapter: FamilyAdapter, modality: Modality, data: bytes, options: ProcessorOptions) -> PreparedItem:
    media = MediaInput(modality, data, options=options)
    return adapter.preprocess(media, media_hash(media), MediaLimits())


def project_prompt(runtime_tokenizer: Any, adapter: FamilyAdapter, prepared: PreparedItem) -> list[int]:
    item = EncodedItem(prepared.layout, {"embeddings": torch.zeros(prepared.layout.placeholder_token_count, 1)})
    message = ChatMessage(ChatRole.USER, (EncodedPart(item), TextPart(PROMPT_TEXT)))
    return build_prompt(runtime_tokenizer, adapter, [message]).input_ids


def compare(
    family: str,
    path: Path,
    adapter: FamilyAdapter,
    tokenizer: Any,
    modality: Modality,
    case: str,
    data: bytes,
    suffix: str,
    options: ProcessorOptions | None = None,
) -> Comparison:
    options = options or ProcessorOptions()
    result = Comparison(family, modality.value, case)
    ref_error: Exception | None = None
    try:
        ref = reference_batch(path, [RefItem(modality, data, suffix, options), PROMPT_TEXT])
    except Exception as exc:  # the reference refuses (e.g. aspect ratio over 200)
        ref_error = exc
    try:
        prepared = project_item(adapter, modality, data, options)
    except EngineError as exc:
        if ref_error is None:
            raise
        assert isinstance(exc, InvalidMediaError), f"{case}: expected InvalidMediaError, got {exc!r}"
        result.error = f"both refuse: {type(ref_error).__name__} / {type(exc).__name__}"
        return result
    if ref_error is not None:
        raise AssertionError(f"{case}: the reference refuses ({ref_error!r}) but the project accepts")
    layout = prepared.layout
    if modality is Modality.IMAGE and has_transparency(reference_image_raw(data)) and not processor_composites_alpha():
        result.note = "alpha onto white (5.23 rule; installed 5.19 drops alpha)"
    if modality is Modality.VIDEO and family == "qwen3_vl":
        result.note = "outer vision markers dropped (original processor rule)"
    if modality is Modality.IMAGE:
        assert layout.image is not None
        result.check("pixel_values", prepared.inputs["pixel_values"], ref["pixel_values"])
        result.check(
            "grid_thw",
            [layout.image.grid_t, layout.image.grid_h, layout.image.grid_w],
            ref["image_grid_thw"][0].tolist(),
        )
    elif modality is Modality.VIDEO:
        assert layout.video is not None
        video = layout.video
        result.check("pixel_values", prepared.inputs["pixel_values"], ref["pixel_values_videos"])
        result.check("grid_thw", [video.grid_t, video.grid_h, video.grid_w], ref["video_grid_thw"][0].tolist())
        seconds = ref.get("second_per_grid_ts", ref.get("video_second_per_grid"))
        if seconds is not None:  # Qwen2.5-VL / Omni; float32 on the reference side
            ref_seconds = float(torch.as_tensor(seconds, dtype=torch.float32)[0])
            ours = float(torch.tensor(video.seconds_per_grid, dtype=torch.float32))
            result.check("seconds_per_grid", ours, ref_seconds)
    else:
        assert layout.audio is not None
        length = int(ref["feature_attention_mask"][0].sum())
        result.check("feature_length", layout.audio.feature_length, length)
        result.check("audio_features", prepared.inputs["input_features"], ref["input_features"][0, :, :length])
    result.check("prompt_ids", project_prompt(tokenizer, adapter, prepared), ref["input_ids"][0].tolist())
    return result


def table() -> list[Comparison]:
    from libs.model.checkpoints import ensure_checkpoint
    from libs.runtime.encoder_runner import EncoderRunner
    from libs.runtime.lm_runtime import LanguageModelRuntime
    from tests.support import media_set

    rows = []
    for family in ("qwen2_5_omni", "qwen2_5_vl", "qwen3_vl"):
        path = ensure_checkpoint(family, "tiny")
        adapter, tokenizer = EncoderRunner(path).adapter, LanguageModelRuntime(path).tokenizer
        pools = [(Modality.IMAGE, media_set.images()), (Modality.VIDEO, media_set.videos())]
        if family == "qwen2_5_omni":
            pools.append((Modality.AUDIO, media_set.audios()))
        for modality, cases in pools:
            for case in cases:
                rows.append(compare(family, path, adapter, tokenizer, modality, case.name, case.data, case.suffix))
    return rows


def main() -> None:
    import transformers

    from tests.support.hf_reference import processor_kind

    rows = table()
    print(f"reference: {processor_kind(Path('.'))}; transformers {transformers.__version__}\n")
    print("| family | modality | case | result | fields compared | max abs diff (floats) | note |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if r.error:
            result, fields, diff = "both refuse", "-", "-"
        else:
            result = "equal" if r.equal else "NOT EQUAL: " + ", ".join(k for k, (ok, _) in r.fields.items() if not ok)
            fields = ", ".join(r.fields)
            diffs = [d for _, d in r.fields.values() if d is not None]
            diff = f"{max(diffs):.3g}" if diffs else "-"
        print(f"| {r.family} | {r.modality} | {r.case} | {result} | {fields} | {diff} | {r.note or r.error or ''} |")


if __name__ == "__main__":
    main()
