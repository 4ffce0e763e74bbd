"""Stand-ins for transformers' torchvision-only Qwen processors, for when torchvision is not importable.

Only what needs torchvision is transcribed; everything else is transformers' own code (the family
processor classes, `Qwen3VLVideoProcessor.sample_frames`, both `smart_resize`s, the PIL backend's RGB
conversion). Written from the installed sources, independently of the project's preprocessing:

- images: `Qwen2VLImageProcessor._preprocess` / `.resize` / `.patchify`
  (transformers/models/qwen2_vl/image_processing_qwen2_vl.py);
- videos: `BaseVideoProcessor._decode_and_sample_videos` (array input: `video[indices]`,
  transformers/video_processing_utils.py), `Qwen2VLVideoProcessor.sample_frames` / `.resize` /
  `.patchify` (video_processing_qwen2_vl.py), `Qwen3VLVideoProcessor.resize` / `.patchify`
  (video_processing_qwen3_vl.py);
- pixels: `TorchvisionBackend.resize` and `.rescale_and_normalize` with `_fuse_mean_std_and_rescale_factor`
  (transformers/image_processing_backends.py), which call torchvision 0.28
  `transforms/v2/functional/_geometry.py::resize_image` (CPU uint8 bicubic: native `interpolate`,
  antialias, no float round trip) and `_misc.py::normalize_image`.

When torchvision is importable the tests use the real classes instead (`hf_reference.py`) and check
these stand-ins against them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from transformers.feature_extraction_utils import BatchFeature
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as qwen2_smart_resize
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as qwen3_smart_resize
from transformers.video_processing_utils import VideoProcessorMixin
from transformers.video_utils import VideoMetadata


def tv_resize_bicubic(images: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """torchvision `resize_image(..., BICUBIC, antialias=True)` on a CPU uint8 [..., C, H, W] tensor."""
    shape = images.shape
    c, h, w = shape[-3:]
    if (h, w) == tuple(size):
        return images
    flat = images.reshape(-1, c, h, w)
    out = torch.nn.functional.interpolate(flat, size=list(size), mode="bicubic", align_corners=False, antialias=True)
    return out.reshape((*shape[:-3], c, size[0], size[1]))


def tv_rescale_and_normalize(images: torch.Tensor, rescale_factor: float, mean: Any, std: Any) -> torch.Tensor:
    """Fused path (do_rescale and do_normalize): mean, std scaled by 1/rescale_factor, then
    `normalize_image` on float32: `image.sub_(mean).div_(std)`."""
    mean_t = torch.tensor(mean) * (1.0 / rescale_factor)
    std_t = torch.tensor(std) * (1.0 / rescale_factor)
    image = images.to(torch.float32)
    mean_t = torch.as_tensor(mean_t, dtype=image.dtype).view(-1, 1, 1)
    std_t = torch.as_tensor(std_t, dtype=image.dtype).view(-1, 1, 1)
    return image.sub_(mean_t).div_(std_t)


class TranscribedQwen2VLImageProcessor(Qwen2VLImageProcessorPil):
    """The PIL class's loading, defaults and RGB conversion (`process_image` gives the torchvision
    backend's values for PIL input), with the torchvision class's `_preprocess`."""

    def _preprocess(  # type: ignore[override]
        self,
        images: list[np.ndarray],
        do_resize: bool,
        size: Any,
        resample: Any,
        do_rescale: bool,
        rescale_factor: float,
        do_normalize: bool,
        image_mean: Any,
        image_std: Any,
        patch_size: int,
        temporal_patch_size: int,
        merge_size: int,
        return_tensors: Any = None,
        **kwargs: Any,
    ) -> BatchFeature:
        assert do_resize and do_rescale and do_normalize, "the transcription covers the default path only"
        all_patches, grids = [], []
        for array in images:
            image = torch.from_numpy(np.ascontiguousarray(array)).unsqueeze(0)  # [1, C, H, W] uint8
            height, width = image.shape[-2:]
            resized = qwen2_smart_resize(
                height,
                width,
                factor=patch_size * merge_size,
                min_pixels=size.shortest_edge,
                max_pixels=size.longest_edge,
            )
            image = tv_rescale_and_normalize(tv_resize_bicubic(image, resized), rescale_factor, image_mean, image_std)
            b, c, rh, rw = image.shape
            gh, gw = rh // patch_size, rw // patch_size
            patches = image.reshape(
                b, c, gh // merge_size, merge_size, patch_size, gw // merge_size, merge_size, patch_size
            )
            patches = patches.permute(0, 2, 5, 3, 6, 1, 4, 7)
            flat = (
                patches.unsqueeze(6)
                .expand(-1, -1, -1, -1, -1, -1, temporal_patch_size, -1, -1)
                .reshape(b, gh * gw, c * temporal_patch_size * patch_size * patch_size)
            )
            all_patches.append(flat[0])
            grids.append([1, gh, gw])
        return BatchFeature(
            data={"pixel_values": torch.cat(all_patches), "image_grid_thw": torch.tensor(grids, dtype=torch.long)},
            tensor_type=return_tensors,
        )


def _qwen2_vl_sample_frames(
    metadata: VideoMetadata, fps: float, temporal_patch_size: int, min_frames: int, max_frames: int
) -> torch.Tensor:
    """`Qwen2VLVideoProcessor.sample_frames` with `fps` given and `num_frames` not."""
    total_num_frames = metadata.total_num_frames
    max_frames = math.floor(min(max_frames, total_num_frames) / temporal_patch_size) * temporal_patch_size
    num_frames = total_num_frames / metadata.fps * fps
    num_frames = min(max(num_frames, min_frames), max_frames, total_num_frames)
    num_frames = math.floor(num_frames / temporal_patch_size) * temporal_patch_size
    return torch.arange(0, total_num_frames, total_num_frames / num_frames).int()


class TranscribedVideoProcessor(VideoProcessorMixin):
    """`Qwen2VLVideoProcessor` (style "qwen2_vl") or `Qwen3VLVideoProcessor` ("qwen3_vl") for array
    input with `video_metadata` (what the tests pass: frames read by `read_video_pyav`)."""

    def __init__(self, style: str, config: dict[str, Any]) -> None:
        super().__init__()
        self.style = style
        if style == "qwen3_vl":
            defaults = {k: getattr(Qwen3VLVideoProcessor, k) for k in ("size", "patch_size", "image_mean", "image_std")}
            defaults["fps"] = Qwen3VLVideoProcessor.fps
        else:  # Qwen2VLVideoProcessor's class attributes
            defaults = {
                "size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768},
                "patch_size": 14,
                "image_mean": [0.48145466, 0.4578275, 0.40821073],
                "image_std": [0.26862954, 0.26130258, 0.27577711],
                "fps": None,
            }
        size = dict(config.get("size") or defaults["size"])
        if style == "qwen2_vl":  # __init__: min/max_pixels keys override size
            size["shortest_edge"] = config.get("min_pixels", size["shortest_edge"])
            size["longest_edge"] = config.get("max_pixels", size["longest_edge"])
        self.size = size
        self.patch_size = int(config.get("patch_size", defaults["patch_size"]))
        self.temporal_patch_size = int(config.get("temporal_patch_size", 2))
        self.merge_size = int(config.get("merge_size", 2))
        self.min_frames = int(config.get("min_frames", 4))
        self.max_frames = int(config.get("max_frames", 768))
        self.fps = config.get("fps", defaults["fps"])
        self.image_mean = list(config.get("image_mean", defaults["image_mean"]))
        self.image_std = list(config.get("image_std", defaults["image_std"]))
        self.rescale_factor = 1 / 255

    def __call__(self, videos: Any, **kwargs: Any) -> BatchFeature:
        return self.preprocess(videos, **kwargs)

    def preprocess(self, videos: Any, **kwargs: Any) -> BatchFeature:  # type: ignore[override]
        size = dict(kwargs.get("size") or self.size)
        fps = kwargs.get("fps", self.fps)
        max_frames = kwargs.get("max_frames", self.max_frames)
        assert kwargs.get("do_sample_frames"), "the tests always sample frames (bounded input)"
        pixel_values, grids, metadata_out = [], [], []
        for video, metadata in zip(videos, kwargs["video_metadata"], strict=True):
            metadata = VideoMetadata(**{k: metadata[k] for k in metadata})
            if self.style == "qwen3_vl":
                # The real method; it reads min/max_frames from the instance, not the call.
                indices = Qwen3VLVideoProcessor.sample_frames(self, metadata, fps=fps)  # type: ignore[arg-type]
            else:
                indices = _qwen2_vl_sample_frames(metadata, fps, self.temporal_patch_size, self.min_frames, max_frames)
            metadata.frames_indices = indices
            frames = torch.from_numpy(np.asarray(video)[indices]).contiguous()  # [T, H, W, C]
            frames = frames.permute(0, 3, 1, 2).contiguous().unsqueeze(0)  # [1, T, C, H, W] uint8
            pixel_values.append(self._resize_normalize_patchify(frames, size))
            grids.append(pixel_values[-1][1])
            metadata_out.append(metadata)
        data = {
            "pixel_values_videos": torch.cat([p[0] for p in pixel_values]),
            "video_grid_thw": torch.tensor(grids),
        }
        if kwargs.get("return_metadata"):
            data["video_metadata"] = metadata_out
        return BatchFeature(data=data, skip_tensor_conversion=["video_metadata"])

    def _resize_normalize_patchify(self, videos: torch.Tensor, size: dict[str, int]) -> tuple[torch.Tensor, list[int]]:
        factor = self.patch_size * self.merge_size
        num_frames, height, width = videos.shape[1], videos.shape[-2], videos.shape[-1]
        if self.style == "qwen3_vl":
            resized = qwen3_smart_resize(
                num_frames=num_frames,
                height=height,
                width=width,
                temporal_factor=self.temporal_patch_size,
                factor=factor,
                min_pixels=size["shortest_edge"],
                max_pixels=size["longest_edge"],
            )
        else:
            resized = qwen2_smart_resize(
                height, width, factor=factor, min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"]
            )
        videos = tv_resize_bicubic(videos, resized)
        videos = tv_rescale_and_normalize(videos, self.rescale_factor, self.image_mean, self.image_std)
        tp, p, m = self.temporal_patch_size, self.patch_size, self.merge_size
        batch, t, c, rh, rw = videos.shape
        if pad := -t % tp:
            videos = torch.cat((videos, videos[:, -1:].expand(-1, pad, -1, -1, -1)), dim=1)
            t += pad
        gt, gh, gw = t // tp, rh // p, rw // p
        patches = videos.view(batch, gt, tp, c, gh // m, m, p, gw // m, m, p).permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
        return patches.reshape(batch * gt * gh * gw, c * tp * p * p), [gt, gh, gw]
