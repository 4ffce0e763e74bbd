"""An Encode call's images as vLLM's renderer would render them, made from the project's pixels.

The vLLM encoder (encoder.py) hands `AsyncLLM` this rendered input (`vllm.inputs.engine.mm_input`),
so vLLM's input processing does not run for images: no prompt to tokenize, no HF processor, no
placeholder search. Why: the project has already decoded, checked and resized each image to the
patch grid (its layout is computed from those pixels); vLLM's processor would only cut them into
patch rows again, the uint8 rows the tower normalizes itself (`mm_device_do_normalize`, vLLM's
default for the Qwen VL families): CPU the encoder service would spend on every call, on a thread
of vLLM's own, behind a handoff from the event loop.

The input is what vLLM's renderer makes of the same pixels, field for field
(tests/backends/test_vllm_encoder_inputs.py): the prompt ids with each item's placeholder expanded
to its rows, the items' `pixel_values` and `image_grid_thw` split per item by the model processor's
own field config, the uuids as the items' hashes, their placeholder ranges. Videos keep vLLM's
processor (Qwen3-VL's video prompt interleaves timestamp text with a video's placeholders): a call
holding any video goes that way whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from libs.model.types import ImageLayout

if TYPE_CHECKING:
    from vllm.inputs.engine import MultiModalInput

# The tokens around one image placeholder in the Qwen VL families' prompts.
VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"


@dataclass(frozen=True)
class ImageTokens:
    start: int
    pad: int  # the placeholder vLLM expands to an image's rows
    end: int

    @classmethod
    def of(cls, tokenizer: Any) -> ImageTokens:
        start, pad, end = (int(tokenizer.convert_tokens_to_ids(t)) for t in (VISION_START, IMAGE_PAD, VISION_END))
        return cls(start, pad, end)


@dataclass(frozen=True)
class RenderedImage:
    patches: torch.Tensor  # [grid_t * grid_h * grid_w, C * tp * p * p], as the tower takes them
    grid: ImageLayout
    rows: int  # placeholder tokens (embedding rows) the image takes
    uuid: str  # the item's hash in vLLM (its encoder cache key, the EC producer's slot key)


def rendered_images(processor: Any, tokens: ImageTokens, images: Sequence[RenderedImage]) -> MultiModalInput:
    """One encoder-only request for `images`, in prompt order, as vLLM's `MultiModalInput`.
    `processor`: the engine renderer's multimodal processor (`renderer.get_mm_processor()`)."""
    from transformers import BatchFeature
    from vllm.inputs.engine import mm_input
    from vllm.multimodal.inputs import MultiModalKwargsItems, PlaceholderRange

    ids: list[int] = []
    ranges: list[PlaceholderRange] = []
    for image in images:
        ids.append(tokens.start)
        ranges.append(PlaceholderRange(offset=len(ids), length=image.rows))
        ids.extend([tokens.pad] * image.rows)
        ids.append(tokens.end)
    grids = torch.tensor([[i.grid.grid_t, i.grid.grid_h, i.grid.grid_w] for i in images])
    batch = BatchFeature({"pixel_values": torch.cat([i.patches for i in images]), "image_grid_thw": grids})
    # The model's own split of the batch into items (what its processor's `apply` uses).
    fields = processor._get_mm_fields_config(batch, {})
    kwargs = MultiModalKwargsItems.from_hf_inputs(batch, fields)
    return mm_input(ids, kwargs, {"image": [i.uuid for i in images]}, {"image": ranges})
