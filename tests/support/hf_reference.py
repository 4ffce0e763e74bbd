"""The families' own transformers processors, as the reference the project's preprocessing must equal.

`reference_processor(path)` is `AutoProcessor.from_pretrained(path)` when torchvision imports (the
Qwen image / video processors are torchvision classes); otherwise the family's processor class
(`Qwen2_5OmniProcessor`, `Qwen2_5_VLProcessor`, `Qwen3VLProcessor`, real) built around the
transcribed image / video processors of `hf_transcription.py`, with the real tokenizer, chat
template and Whisper feature extractor.

Media reach the processors the way transformers' own loaders deliver them:
- image: `image_utils.load_image` without its final `convert("RGB")` (open + EXIF transpose), so
  the processor's own RGB conversion applies (alpha onto white in 5.23);
- audio: `audio_utils.load_audio` with the soundfile backend (5.23), or 5.19's `librosa` backend
  (`librosa.load`, which 5.23 documents as identical) when librosa is installed, else the same steps
  transcribed from 5.23's `_load_audio_soundfile`;
- video: `video_utils.read_video_pyav` decoding every frame, then the processor samples
  (`do_sample_frames=True` with `fps`, the path `apply_chat_template` takes when fps is given).
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import math
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
from PIL import Image, ImageOps

from libs.model.types import Modality, ProcessorOptions

REPO = Path(__file__).resolve().parents[2]
# What the released Qwen2.5-Omni tokenizer config names (the processor reads tokenizer.image_token...).
OMNI_NAMED_TOKENS = {
    "image_token": "<|IMAGE|>",
    "audio_token": "<|AUDIO|>",
    "video_token": "<|VIDEO|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
}


@cache
def torchvision_ready() -> bool:
    """True when torchvision imports, after the project's torchvision guard (if the checkout has one:
    a `libs/**/*guard*.py` module with `install()`) has run."""
    if importlib.util.find_spec("torchvision") is None:
        return False
    for guard in sorted(REPO.glob("libs/**/*guard*.py")):
        module = importlib.import_module(".".join(guard.relative_to(REPO).with_suffix("").parts))
        if hasattr(module, "install"):
            module.install()
    try:
        import torchvision  # noqa: F401
    except Exception:
        return False
    return True


def family_of(path: Path) -> str:
    import json

    model_type = json.loads((path / "config.json").read_text()).get("model_type", "")
    return {"qwen2_5_omni_thinker": "qwen2_5_omni"}.get(model_type, model_type)


def _tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if family_of(path) == "qwen2_5_omni" and not hasattr(tokenizer, "image_token"):
        tokenizer = AutoTokenizer.from_pretrained(str(path), model_specific_special_tokens=OMNI_NAMED_TOKENS)
    return tokenizer


@cache
def reference_processor(path: Path, *, transcribed: bool = False) -> Any:
    """`transcribed`: the stand-in even when torchvision imports (to check it against the real one)."""
    tokenizer = _tokenizer(path)
    if torchvision_ready() and not transcribed:
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(str(path), tokenizer=tokenizer)
    from transformers import WhisperFeatureExtractor
    from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import Qwen2_5OmniProcessor
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_processing_utils import VideoProcessorMixin

    from tests.support.hf_transcription import TranscribedQwen2VLImageProcessor, TranscribedVideoProcessor

    family = family_of(path)
    image = TranscribedQwen2VLImageProcessor.from_pretrained(str(path))
    raw, _ = VideoProcessorMixin.get_video_processor_dict(str(path))
    style = {"Qwen3VLVideoProcessor": "qwen3_vl", "Qwen2VLVideoProcessor": "qwen2_vl"}.get(
        str(raw.get("video_processor_type")), "qwen3_vl" if family == "qwen3_vl" else "qwen2_vl"
    )
    video = TranscribedVideoProcessor(style, raw)
    parts: dict[str, Any] = {"image_processor": image, "video_processor": video, "tokenizer": tokenizer}
    cls: Any = {"qwen2_5_omni": Qwen2_5OmniProcessor, "qwen2_5_vl": Qwen2_5_VLProcessor}.get(family, Qwen3VLProcessor)
    if family == "qwen2_5_omni":
        parts["feature_extractor"] = WhisperFeatureExtractor.from_pretrained(str(path))
    check = cls.check_argument_for_proper_class

    def check_parts(self: Any, name: str, argument: Any) -> Any:
        # The base check finds `VideoProcessorMixin` through a mapping that is a stub without
        # torchvision; everything else is checked as usual.
        if name == "video_processor":
            assert isinstance(argument, VideoProcessorMixin)
            return VideoProcessorMixin
        return check(self, name, argument)

    with mock.patch.object(cls, "check_argument_for_proper_class", check_parts):
        return cls(**parts, chat_template=tokenizer.chat_template)


def processor_kind(path: Path) -> str:
    return "transformers (torchvision)" if torchvision_ready() else "transformers + transcribed torchvision parts"


# ---- media, as transformers' loaders deliver them ------------------------------------------------


def reference_image(data: bytes) -> Image.Image:
    """`load_image` up to (not including) its `convert("RGB")`: open, EXIF transpose. Where the
    installed processor drops transparency (transformers 5.19's `convert_to_rgb`), the image is first
    composited onto white by 5.23's rule: the project follows 5.23 / qwen-vl-utils (docs/runtime.md)."""
    image = reference_image_raw(data)
    if has_transparency(image) and not processor_composites_alpha():
        return composite_on_white(image)
    return image


def reference_image_raw(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    return ImageOps.exif_transpose(image)


def has_transparency(image: Image.Image) -> bool:
    return "A" in image.getbands() or image.info.get("transparency") is not None


def composite_on_white(image: Image.Image) -> Image.Image:
    """transformers 5.23 `image_transforms.convert_to_rgb` for a PIL image with transparency."""
    rgba = image.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


@cache
def processor_composites_alpha() -> bool:
    """Whether the installed processors' RGB conversion puts a transparent pixel on white (5.23) or
    drops its alpha (5.19)."""
    from transformers.image_transforms import convert_to_rgb

    out = convert_to_rgb(Image.new("RGBA", (1, 1), (0, 0, 0, 0)))
    return bool(np.asarray(out).reshape(-1)[:3].tolist() == [255, 255, 255])


def _as_file(data: bytes, suffix: str) -> str:
    with tempfile.NamedTemporaryFile(suffix="." + suffix, delete=False) as f:
        f.write(data)
        return f.name


def reference_audio(data: bytes, suffix: str, sampling_rate: int) -> np.ndarray:
    from transformers import audio_utils

    path = _as_file(data, suffix)
    try:
        if hasattr(audio_utils, "_load_audio_soundfile"):  # 5.23
            return audio_utils.load_audio(path, sampling_rate, backend="soundfile")
        if importlib.util.find_spec("librosa") is not None:  # 5.19
            return audio_utils.load_audio(path, sampling_rate, backend="librosa")
        return _transcribed_soundfile_load(path, sampling_rate)
    finally:
        Path(path).unlink()


def _transcribed_soundfile_load(path: str, sampling_rate: int) -> np.ndarray:
    """transformers 5.23 `audio_utils._load_audio_soundfile` (= `librosa.load`)."""
    import soundfile as sf
    import soxr

    with sf.SoundFile(path) as f:
        src_sampling_rate = f.samplerate
        waveform = f.read(dtype="float32", always_2d=True).T
    waveform = waveform.mean(axis=0) if waveform.shape[0] > 1 else waveform[0]
    if src_sampling_rate != sampling_rate:
        num_samples = math.ceil(waveform.shape[-1] * sampling_rate / src_sampling_rate)
        waveform = soxr.resample(waveform, src_sampling_rate, sampling_rate, quality="soxr_hq")
        waveform = np.pad(waveform, (0, max(0, num_samples - len(waveform))))[:num_samples]
    return np.ascontiguousarray(waveform, dtype=np.float32)


def reference_video(data: bytes, suffix: str) -> tuple[np.ndarray, Any]:
    """Every frame (`read_video_pyav`) and fresh metadata for the processor to sample from."""
    from transformers.video_utils import VideoMetadata, read_video_pyav

    path = _as_file(data, suffix)
    try:
        frames, meta = read_video_pyav(
            path, sample_indices_fn=lambda metadata, **kw: np.arange(metadata.total_num_frames)
        )
    finally:
        Path(path).unlink()
    fresh = VideoMetadata(
        total_num_frames=meta.total_num_frames,
        fps=meta.fps,
        width=meta.width,
        height=meta.height,
        duration=meta.duration,
        video_backend="pyav",
    )
    return frames, fresh


# ---- one processor call for a user turn ------------------------------------------------------------


@dataclass(frozen=True)
class RefItem:
    """A media item as the reference gets it: bytes, a file suffix for the path-based loaders, and
    the request's processor options."""

    modality: Modality
    data: bytes
    suffix: str
    options: ProcessorOptions = field(default_factory=ProcessorOptions)


VIDEO_TRIPLE = {"qwen3_vl": "<|vision_start|><|video_pad|><|vision_end|>"}


def render_prompt(path: Path, parts: Sequence[str | RefItem], *, trained_video_markers: bool = True) -> str:
    """The tokenizer's chat template over one user turn. For Qwen3-VL, `trained_video_markers`
    applies the original processor's rule (transformers 4.x `Qwen3VLProcessor.__call__`): the
    template's `<|vision_start|><|video_pad|><|vision_end|>` is replaced as a whole by the per-frame
    sequence, i.e. the outer pair goes (transformers 5.x keeps it; docs/runtime.md)."""
    content = [
        {"type": "text", "text": part} if isinstance(part, str) else {"type": part.modality.value} for part in parts
    ]
    tokenizer = reference_processor(path).tokenizer
    text: str = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    triple = VIDEO_TRIPLE.get(family_of(path))
    if triple and trained_video_markers:
        text = text.replace(triple, "<|video_pad|>")
    return text


def _size(options: ProcessorOptions, default: Any) -> dict[str, int] | None:
    if options.min_pixels is None and options.max_pixels is None:
        return None
    lo = options.min_pixels if options.min_pixels is not None else default["shortest_edge"]
    hi = options.max_pixels if options.max_pixels is not None else default["longest_edge"]
    return {"shortest_edge": int(lo), "longest_edge": int(hi)}


def _processor_video_size(cls: Any) -> Any:
    """The family processor's own video size default: class attribute (5.23) or `_defaults` (5.19)."""
    size = (getattr(cls, "videos_kwargs", None) or {}).get("size")
    defaults = getattr(getattr(cls, "valid_processor_kwargs", None), "_defaults", {})
    return defaults.get("videos_kwargs", {}).get("size", size)


def _one_options(items: list[RefItem]) -> ProcessorOptions:
    options = {item.options for item in items}
    assert len(options) <= 1, "one processor call takes one set of options per modality"
    return options.pop() if options else ProcessorOptions()


def reference_batch(path: Path, parts: Sequence[str | RefItem], *, trained_video_markers: bool = True) -> Any:
    """The family processor's output (`BatchFeature`, tensors) for one user turn of `parts`."""
    processor = reference_processor(path)
    family = family_of(path)
    items = [p for p in parts if isinstance(p, RefItem)]
    images = [reference_image(i.data) for i in items if i.modality is Modality.IMAGE]
    videos = [reference_video(i.data, i.suffix) for i in items if i.modality is Modality.VIDEO]
    rate = int(processor.feature_extractor.sampling_rate) if family == "qwen2_5_omni" else 16000
    audio = [reference_audio(i.data, i.suffix, rate) for i in items if i.modality is Modality.AUDIO]
    kwargs: dict[str, Any] = {}
    image_options = _one_options([i for i in items if i.modality is Modality.IMAGE])
    if (size := _size(image_options, processor.image_processor.size)) is not None:
        kwargs["images_kwargs"] = {"size": size}
    video_processor = processor.video_processor
    saved_max_frames = video_processor.max_frames
    if videos:
        options = _one_options([i for i in items if i.modality is Modality.VIDEO])
        fps = options.video_fps if options.video_fps is not None else (video_processor.fps or 2.0)
        videos_kwargs: dict[str, Any] = {
            "fps": fps,
            "do_sample_frames": True,
            "video_metadata": [meta for _, meta in videos],
        }
        default_size = _processor_video_size(type(processor)) or video_processor.size
        if (size := _size(options, default_size)) is not None:
            videos_kwargs["size"] = size
        if options.video_max_frames is not None:
            # "max frames" = the video processor's setting (Qwen3-VL's sample_frames reads only that).
            video_processor.max_frames = options.video_max_frames
        kwargs["videos_kwargs"] = videos_kwargs
    try:
        return processor(
            text=[render_prompt(path, parts, trained_video_markers=trained_video_markers)],
            images=images or None,
            videos=[frames for frames, _ in videos] or None,
            audio=audio or None,
            return_tensors="pt",
            **kwargs,
        )
    finally:
        video_processor.max_frames = saved_max_frames
