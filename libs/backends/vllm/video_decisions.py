"""The project's two video preprocessing decisions, applied to what vLLM is given
(docs/runtime.md, "Preprocessing decisions"), so a video's prompt and M-RoPE positions on vLLM are
the reference runtime's:

- **Qwen2.5-VL (and Omni) temporal step.** vLLM's M-RoPE reads a video's `second_per_grid_ts`
  from the item's multimodal fields and takes 1.0 s per grid when it is absent. Its pixel path has
  the field; its metadata-only (embedding) path, the one EPD uses, has no field config for it and
  drops it. `accept_second_per_grid_ts` adds the config to that path (one of the project's vLLM
  patches, patches.py: the plugin installs it in each of vLLM's processes, the service's, which
  parses requests, among them); the planner passes the layout's `seconds_per_grid`.
- **Qwen3-VL outer markers.** The project's video is, per temporal patch,
  `<t seconds><|vision_start|>` + pads + `<|vision_end|>`, with nothing around it. vLLM expands a
  prompt's video placeholder into the same per-patch sequence; with transformers >= 5.10 it
  expands the bare `<|video_pad|>` and keeps the template's outer `<|vision_start|>` /
  `<|vision_end|>`, so `without_outer_video_markers` removes that pair from the ids (with an older
  processor vLLM replaces the whole triple itself and the ids are left as they are).
"""

from __future__ import annotations

import functools
from typing import Any

# Families whose vLLM M-RoPE takes a video's temporal step from `second_per_grid_ts`.
SECONDS_PER_GRID_FAMILIES = frozenset({"qwen2_5_vl", "qwen2_5_omni"})
MARK = "epd_second_per_grid_ts"  # carried by the project's parser method (patches.py checks it)


def accept_second_per_grid_ts() -> None:
    """Give vLLM's metadata-only video input a `second_per_grid_ts` field (batched per video, on
    the CPU, as its pixel path declares it). Only the parser's dict (embedding) branch changes:
    the pixel path's field config (`Qwen2_5_VLMultiModalProcessor._get_mm_fields_config`) adds the
    field itself on top of the same factory, so the factory must stay as it is (patching it broke
    every Qwen2.5-VL pixel request: the field was declared twice). Qwen2.5-VL's, Omni's and
    Qwen3-VL's parsers inherit this branch; a request without the field is parsed as before.
    Idempotent."""
    from vllm.model_executor.models import qwen2_vl
    from vllm.multimodal.inputs import MultiModalFieldConfig
    from vllm.multimodal.parse import DictEmbeddingItems

    parser = qwen2_vl.Qwen2VLMultiModalDataParser
    shipped = parser._parse_video_data
    if getattr(shipped, MARK, False):
        return

    @functools.wraps(shipped)  # `__wrapped__`: vLLM's own method
    def parse_video_data(self: Any, data: Any) -> Any:
        if not isinstance(data, dict):
            return shipped(self, data)
        factory = qwen2_vl._create_qwen2vl_field_factory(self._spatial_merge_size)

        def fields(hf_inputs: Any) -> Any:
            return {
                **factory(hf_inputs),
                "second_per_grid_ts": MultiModalFieldConfig.batched("video", keep_on_cpu=True),
            }

        required, optional = self.embedding_field_sets("video")  # as vLLM's own dict branch
        return DictEmbeddingItems(
            data, modality="video", required_fields=required, optional_fields=optional, fields_factory=fields
        )

    setattr(parse_video_data, MARK, True)
    setattr(parser, "_parse_video_data", parse_video_data)  # noqa: B010 (a method of vLLM's class)


def vllm_keeps_outer_video_markers() -> bool:
    """What vLLM's Qwen3-VL processor does with the installed transformers: it expands only the
    bare video token (keeping the outer pair) when the processor class overrides
    `replace_video_token` (vLLM 0.32 `Qwen3VLMultiModalProcessor._expands_only_video_token`)."""
    from transformers import ProcessorMixin
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    own = getattr(Qwen3VLProcessor, "replace_video_token", None)
    return own is not None and own is not getattr(ProcessorMixin, "replace_video_token", None)


def without_outer_video_markers(ids: list[int], *, start: int, video: int, end: int) -> list[int]:
    """`ids` with every `start video end` triple reduced to `video`."""
    out: list[int] = []
    i = 0
    while i < len(ids):
        if ids[i : i + 3] == [start, video, end]:
            out.append(video)
            i += 3
        else:
            out.append(ids[i])
            i += 1
    return out
