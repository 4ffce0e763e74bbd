"""The varied media the parity tests run on, generated here (nothing is downloaded).

Images: odd and extreme sizes and aspect ratios, grayscale, 1-bit, RGBA, LA, palette with and
without transparency, CMYK JPEG, EXIF-rotated JPEG, 16-bit grayscale PNG. Audio: stereo and 5.1
at 8 / 22.05 / 44.1 / 48 kHz, mono at 16 / 22.05 kHz, short and long, WAV / FLAC / OGG / MP3.
Video: odd frame rates (7, 12.5, 29.97, 60 fps), short and long clips (frame caps hit), odd sizes.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from fractions import Fraction
from functools import cache

import av
import numpy as np
from PIL import Image

from libs.model.media import synthetic


@dataclass(frozen=True)
class Case:
    name: str
    data: bytes
    suffix: str  # file extension, for references that read paths


def _gradient(width: int, height: int, seed: int) -> np.ndarray:
    """Smooth content plus noise: resampling differences show, unlike pure noise or flat colour."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / max(width - 1, 1), y * 255 / max(height - 1, 1), (x + y) % 256], axis=-1)
    return np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)


def _encode(image: Image.Image, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kw)
    return buf.getvalue()


# Cases the reference refuses (aspect ratio over 200): the project must refuse them too.
REFUSED = frozenset({"ratio_240_1200x5"})


@cache
def images() -> tuple[Case, ...]:
    rgb = Image.fromarray(_gradient(97, 61, 1))
    alpha = Image.fromarray(np.tile(np.linspace(0, 255, 97, dtype=np.uint8), (61, 1)))
    rgba = rgb.copy()
    rgba.putalpha(alpha)
    palette = rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=64)
    transparent = palette.copy()
    transparent.info["transparency"] = 3
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to view
    gray16 = Image.fromarray(_gradient(50, 70, 3)[..., 0].astype(np.uint16) * 257)  # mode I;16
    return (
        Case("rgb_97x61", _encode(rgb, "PNG"), "png"),
        Case("tiny_3x5", _encode(Image.fromarray(_gradient(3, 5, 2)), "PNG"), "png"),
        Case("wide_1000x6", _encode(Image.fromarray(_gradient(1000, 6, 4)), "PNG"), "png"),
        Case("tall_9x1700", _encode(Image.fromarray(_gradient(9, 1700, 5)), "PNG"), "png"),
        Case("ratio_240_1200x5", _encode(Image.fromarray(_gradient(1200, 5, 7)), "PNG"), "png"),
        Case("large_1500x1100", _encode(Image.fromarray(_gradient(1500, 1100, 6)), "JPEG", quality=90), "jpg"),
        Case("gray_L", _encode(rgb.convert("L"), "PNG"), "png"),
        Case("bilevel_1", _encode(rgb.convert("1"), "PNG"), "png"),
        Case("rgba", _encode(rgba, "PNG"), "png"),
        Case("gray_alpha_LA", _encode(rgba.convert("LA"), "PNG"), "png"),
        Case("palette_P", _encode(palette, "PNG"), "png"),
        Case("palette_transparency", _encode(transparent, "PNG", transparency=3), "png"),
        Case("cmyk_jpeg", _encode(rgb.convert("CMYK"), "JPEG", quality=92), "jpg"),
        Case("exif_rotated_jpeg", _encode(rgb, "JPEG", quality=92, exif=exif), "jpg"),
        Case("gray16_png", _encode(gray16, "PNG"), "png"),
        Case("gif", _encode(palette, "GIF"), "gif"),
    )


@cache
def audios() -> tuple[Case, ...]:
    cases = [
        Case(
            f"wav_{rate}hz_{channels}ch",
            synthetic.audio_bytes(1.3, seed=rate + channels, rate=rate, channels=channels),
            "wav",
        )
        for rate, channels in ((16000, 1), (22050, 1), *((r, c) for r in (8000, 22050, 44100, 48000) for c in (2, 6)))
    ]
    cases += [
        Case("flac_44100hz_2ch", synthetic.audio_bytes(2.0, seed=7, rate=44100, channels=2, fmt="FLAC"), "flac"),
        Case("ogg_48000hz_2ch", synthetic.audio_bytes(2.0, seed=8, rate=48000, channels=2, fmt="OGG"), "ogg"),
        Case(
            "mp3_44100hz_2ch",
            synthetic.audio_bytes(2.0, seed=9, rate=44100, channels=2, fmt="MP3", subtype="MPEG_LAYER_III"),
            "mp3",
        ),
        Case("short_0.05s_48000hz", synthetic.audio_bytes(0.05, seed=10, rate=48000, channels=2), "wav"),
        Case("long_29.5s_44100hz_2ch", synthetic.audio_bytes(29.5, seed=11, rate=44100, channels=2), "wav"),
    ]
    return tuple(cases)


def video_bytes(width: int, height: int, *, frames: int, fps: Fraction, seed: int) -> bytes:
    """MPEG-4 part 2 in MP4 at an exact (possibly fractional) frame rate, smooth moving content."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            pixels = np.roll(_gradient(width, height, seed), shift=3 * i, axis=1)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


@cache
def videos() -> tuple[Case, ...]:
    return (
        Case("7fps_2.3s_64x48", video_bytes(64, 48, frames=16, fps=Fraction(7), seed=1), "mp4"),
        Case("12.5fps_0.64s_50x30", video_bytes(50, 30, frames=8, fps=Fraction(25, 2), seed=2), "mp4"),
        Case("29.97fps_3.3s_96x54", video_bytes(96, 54, frames=100, fps=Fraction(30000, 1001), seed=3), "mp4"),
        Case("60fps_10s_capped_32x128", video_bytes(32, 128, frames=600, fps=Fraction(60), seed=4), "mp4"),
        Case("4fps_10s_capped_64x48", video_bytes(64, 48, frames=40, fps=Fraction(4), seed=5), "mp4"),
        Case("3_frames_2fps_40x40", video_bytes(40, 40, frames=3, fps=Fraction(2), seed=6), "mp4"),
    )
