"""The request mixes every family is checked on: text, images, video, audio and combinations."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from libs.engine.media import synthetic
from libs.engine.types import MediaInput, Modality


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
def _audio(seconds: float, seed: int) -> bytes:
    return synthetic.wav_bytes(seconds, seed=seed)


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
        ]
    return out
