"""The pixel operations give the same values whatever the memory layout of their input: decoded
images stay channels last (one copy of the pixels), the processors they stand for get contiguous
channels-first tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from libs.model.media.pixels import image_to_chw, normalize, patchify, resize_bicubic

pytestmark = pytest.mark.unit

MEAN, STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


@pytest.mark.parametrize(("source", "target"), [((224, 224), (112, 112)), ((97, 513), (56, 252)), ((33, 35), (56, 56))])
def test_resize_and_normalize_ignore_the_layout(source: tuple[int, int], target: tuple[int, int]) -> None:
    rgb = np.random.default_rng(sum(source)).integers(0, 256, (*source, 3), dtype=np.uint8)
    channels_last = image_to_chw(Image.fromarray(rgb)).unsqueeze(0)
    assert channels_last.shape == (1, 3, *source) and not channels_last.is_contiguous()
    channels_first = torch.from_numpy(rgb).permute(2, 0, 1).contiguous().unsqueeze(0)
    assert torch.equal(channels_last, channels_first)
    resized = resize_bicubic(channels_last, *target)
    assert torch.equal(resized, resize_bicubic(channels_first, *target))
    # Unresized too: the same size returns the input as it is, channels last.
    assert torch.equal(normalize(channels_last, MEAN, STD), normalize(channels_first, MEAN, STD))
    stored_last = resized.contiguous(memory_format=torch.channels_last)
    assert torch.equal(
        patchify(normalize(resized, MEAN, STD), 14, 2, 2)[0], patchify(normalize(stored_last, MEAN, STD), 14, 2, 2)[0]
    )
