"""The vLLM encoder's rendered image input (libs/backends/vllm/encoder_inputs.py) against what vLLM's
own renderer makes of the same pixels (the encoder's request before: raw resized pixels,
`do_resize=False`), field for field: prompt ids, placeholder ranges, hashes, and every item's tensors
with their field configs. Both Qwen VL families, with the tower normalizing uint8 rows (vLLM's
default) and with vLLM's processor normalizing them (`mm_device_do_normalize=False`). No engine
starts: vLLM's renderer runs in this process."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from libs.backends.vllm.encoder_inputs import ImageTokens, RenderedImage, rendered_images
from libs.model import types as eng
from libs.model.checkpoint import Checkpoint
from libs.model.checkpoints import ensure_checkpoint
from libs.model.families import adapter_for
from libs.model.media import synthetic
from libs.model.media.limits import MediaLimits

pytestmark = [pytest.mark.vllm]

# Three sizes: two resized down to different grids, one kept as it is.
IMAGES = (
    synthetic.png_bytes(112, 84, seed=1),
    synthetic.png_bytes(56, 84, seed=2),
    synthetic.png_bytes(224, 224, seed=3),
)


def _renderer(family: str, device_normalizes: bool) -> tuple[Any, Any]:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.renderers.registry import renderer_from_config

    model = ensure_checkpoint(family, "tiny")
    config = EngineArgs(
        model=str(model),
        max_model_len=4096,
        enforce_eager=True,
        mm_encoder_only=True,
        mm_processor_cache_gb=0,
        mm_device_do_normalize=device_normalizes,
    ).create_engine_config()
    assert config.model_config.multimodal_config.mm_device_do_normalize is device_normalizes
    return config, renderer_from_config(config)


def _fields(rendered: Any) -> list[dict[str, Any]]:
    return [dict(item) for item in rendered["mm_kwargs"]["image"]]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("device_normalizes", [True, False], ids=["tower-normalizes", "processor-normalizes"])
def test_rendered_images_equal_what_vllms_renderer_makes_of_the_same_pixels(
    family: str, device_normalizes: bool
) -> None:
    from vllm.renderers.inputs.preprocess import parse_model_prompt

    config, renderer = _renderer(family, device_normalizes)
    vision = adapter_for(Checkpoint(ensure_checkpoint(family, "tiny"))).vision
    resized = [vision.resized_image(data, eng.ProcessorOptions(), MediaLimits()) for data in IMAGES]
    uuids = [f"item-{i}" for i in range(len(IMAGES))]

    prompt = {
        "prompt": "<|vision_start|><|image_pad|><|vision_end|>" * len(IMAGES),
        "multi_modal_data": {"image": [r[0].permute(1, 2, 0).contiguous().numpy() for r in resized]},
        "multi_modal_uuids": {"image": uuids},
        "mm_processor_kwargs": {"do_resize": False},
    }
    (theirs,) = renderer.render_cmpl(
        [parse_model_prompt(config.model_config, prompt)], renderer.default_cmpl_tok_params
    )

    merge = vision.image_settings.merge_size
    images = []
    for r, uuid in zip(resized, uuids, strict=True):
        grid = vision.image_grid(r)
        rows = grid.grid_t * grid.grid_h * grid.grid_w // merge**2
        # As the encoder gives them: uint8 for a tower that normalizes, else in the engine's dtype
        # (bfloat16 here: vLLM's `auto` for a float32 checkpoint on this CPU).
        patches = vision.image_patches(r, normalized=not device_normalizes)
        if not device_normalizes:
            patches = patches.to(config.model_config.dtype)
        images.append(RenderedImage(patches, grid, rows, uuid))
    ours = rendered_images(renderer.get_mm_processor(), ImageTokens.of(renderer.get_tokenizer()), images)

    assert ours["type"] == theirs["type"] == "multimodal"
    assert ours["prompt_token_ids"] == theirs["prompt_token_ids"]
    assert ours["mm_placeholders"] == theirs["mm_placeholders"]
    # The uuids as the items' hashes; vLLM's renderer hashes each uuid with the request's processor
    # kwargs (`do_resize`). Either way the producer finds an item's slot by its position
    # (ec_producer.py).
    assert ours["mm_hashes"] == {"image": uuids} and len(theirs["mm_hashes"]["image"]) == len(uuids)
    # Different grids, so a misplaced split or item order cannot pass.
    assert len({tuple(r.shape) for r in resized}) == len(IMAGES)
    for mine, vllms in zip(_fields(ours), _fields(theirs), strict=True):
        assert mine.keys() == vllms.keys() == {"pixel_values", "image_grid_thw"}
        for key in mine:
            assert mine[key].field == vllms[key].field, key
            assert mine[key].data.dtype == vllms[key].data.dtype, key
            if device_normalizes:
                assert mine[key].data.dtype in (torch.uint8, torch.int64)
                assert torch.equal(mine[key].data, vllms[key].data), key
            else:  # the project's normalize against the processor's, rounded to the same dtype
                torch.testing.assert_close(mine[key].data, vllms[key].data, rtol=0, atol=0)
