"""The request mixes every family is checked on: text, images, video, audio and combinations."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from libs.model.media import synthetic
from libs.model.types import MediaInput, Modality


@dataclass(frozen=True)
class Mix:
    name: str
    media: tuple[MediaInput, ...]
    parts: tuple[str | int, ...]  # text, or the index of a media item


@cache
def _image(w: int, h: int, seed: int) -> bytes:
    return synthetic.png_bytes(w, h, seed=seed)


@cache
def _video() -> bytes:
    # Wide, so that every family gets several tokens per frame (Qwen3-VL's tiny pixel budget counts
    # all frames); 8 frames at 4 fps sample to 4 at 2 fps, exactly 2 frames per second.
    return synthetic.video_bytes(128, 32, frames=8, fps=4, seed=3)


@cache
def _capped_video() -> bytes:
    # 10 s at 4 fps: 20 frames at 2 fps, capped by the tiny checkpoints' max_frames (8). The Omni
    # processor's seconds per grid is then temporal patch / fps = 1.0, not the 2.5 s a patch spans.
    return synthetic.video_bytes(128, 32, frames=40, fps=4, seed=7)


@cache
def _exif_jpeg() -> bytes:
    # A JPEG whose EXIF orientation (6) turns it upright: landscape pixels, portrait image.
    return media_set_case("exif_rotated_jpeg")


@cache
def _audio(seconds: float, seed: int) -> bytes:
    return synthetic.wav_bytes(seconds, seed=seed)


@cache
def _stereo_44k() -> bytes:
    # Stereo at 44.1 kHz: channel average and soxr resampling to 16 kHz.
    return synthetic.audio_bytes(1.2, seed=8, rate=44100, channels=2)


def media_set_case(name: str) -> bytes:
    from tests.support.media_set import images

    return next(c.data for c in images() if c.name == name)


def mixes(modalities: frozenset[Modality]) -> list[Mix]:
    out = [
        Mix("text", (), ("Describe the quick brown fox in one sentence.",)),
        Mix("image", (MediaInput(Modality.IMAGE, _image(40, 120, 1)),), ("what is in this image", 0)),
        Mix(
            "two_images",
            (
                MediaInput(Modality.IMAGE, _image(40, 120, 1)),  # tall: a swapped grid moves many rows
                MediaInput(Modality.IMAGE, _image(120, 50, 4), item_index=1),
            ),
            ("first", 0, "second", 1, "which is red"),
        ),
        Mix("video", (MediaInput(Modality.VIDEO, _video()),), (0, "describe the video")),
        Mix("video_capped", (MediaInput(Modality.VIDEO, _capped_video()),), ("what happens", 0)),
        Mix("image_exif", (MediaInput(Modality.IMAGE, _exif_jpeg()),), (0, "which way is up")),
    ]
    if Modality.AUDIO in modalities:
        out += [
            Mix("audio", (MediaInput(Modality.AUDIO, _audio(1.5, 2)),), (0, "what is this sound")),
            Mix(
                "audio_image",
                (
                    MediaInput(Modality.AUDIO, _audio(1.0, 5)),
                    MediaInput(Modality.IMAGE, _image(84, 56, 6), item_index=1),
                ),
                (0, 1, "does the sound fit the picture"),
            ),
            Mix("audio_stereo_44k", (MediaInput(Modality.AUDIO, _stereo_44k()),), ("listen", 0)),
        ]
    return out
