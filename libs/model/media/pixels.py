"""Pixel operations of transformers' torchvision ("fast") image and video processors, in plain torch.

The Qwen families' default processors (`Qwen2VLImageProcessor`, `Qwen2VLVideoProcessor`,
`Qwen3VLVideoProcessor`) run on `TorchvisionBackend` (transformers `image_processing_backends.py`),
which calls torchvision's `transforms.v2.functional`. torchvision is not a dependency here, so the
two calls they make are transcribed:

- `TorchvisionBackend.resize` -> `tvF.resize(..., BICUBIC, antialias=True)` -> torchvision 0.28
  `_geometry.resize_image`: on CPU, uint8 bicubic is resized natively (no float round trip) with
  `torch.nn.functional.interpolate(mode="bicubic", align_corners=False, antialias=True)`, and an
  unchanged size returns the input as is.
- `TorchvisionBackend.rescale_and_normalize` (fused): mean and std are scaled by 1 / rescale_factor
  in float32, then `tvF.normalize` -> `_misc.normalize_image`: `(x - mean) / std` in float32.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image

RESCALE_FACTOR = 1 / 255  # the processors' default rescale_factor


def image_to_chw(image: Image.Image) -> torch.Tensor:
    """An RGB image as a [3, H, W] uint8 tensor (what `process_image` hands on), over one copy of
    its pixels as decoded, channels last: `resize_bicubic` reads that layout faster than a
    channels-first copy and gives the same pixels (`make bench-pixels`)."""
    return torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1)


def resize_bicubic(images: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[N, C, H, W] uint8 (any strides) -> [N, C, height, width] uint8, as `tvF.resize(BICUBIC,
    antialias=True)`: the same pixels whether the input is stored channels first or last."""
    if images.dtype != torch.uint8 or images.dim() != 4:
        raise TypeError(f"expected [N, C, H, W] uint8, got {tuple(images.shape)} {images.dtype}")
    if tuple(images.shape[-2:]) == (height, width):
        return images
    return torch.nn.functional.interpolate(
        images, size=[height, width], mode="bicubic", align_corners=False, antialias=True
    )


def normalize(images: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """uint8 pixels -> float32 `(x - mean/r) / (std/r)` with r = 1/255, the fused rescale + normalize."""
    scaled_mean = torch.tensor(list(mean)) * (1.0 / RESCALE_FACTOR)
    scaled_std = torch.tensor(list(std)) * (1.0 / RESCALE_FACTOR)
    out = images.contiguous().to(torch.float32)  # channels first for `patchify` (cheaper in uint8)
    return out.sub_(scaled_mean.view(-1, 1, 1)).div_(scaled_std.view(-1, 1, 1))


def patchify(frames: torch.Tensor, patch: int, merge: int, temporal_patch: int) -> tuple[torch.Tensor, int, int, int]:
    """[T, C, H, W] frames (normalized floats, or uint8 for a tower that normalizes them) ->
    ([grid_t * grid_h * grid_w, C * tp * p * p], grid_t, grid_h, grid_w), rows in the order the Qwen
    vision towers read them. T is padded to a multiple of the temporal patch by repeating the last
    frame (the video processors' `patchify`; an image is one frame repeated, which equals the image
    processor's `expand` over the temporal axis)."""
    if pad := -frames.shape[0] % temporal_patch:
        frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)], dim=0)
    t, c, h, w = frames.shape
    gt, gh, gw = t // temporal_patch, h // patch, w // patch
    patches = frames.reshape(gt, temporal_patch, c, gh // merge, merge, patch, gw // merge, merge, patch)
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(gt * gh * gw, c * temporal_patch * patch * patch), gt, gh, gw
