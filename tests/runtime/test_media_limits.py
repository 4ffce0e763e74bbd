"""Media decoding refuses what it cannot bound or decode with typed errors naming the problem, before
doing the work; and handles the inputs the reference loaders cannot (documented extensions)."""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable
from fractions import Fraction

import av
import numpy as np
import pytest
import soundfile as sf

from libs.model.content import media_hash
from libs.model.errors import InvalidMediaError, MediaLimitError
from libs.model.media import synthetic
from libs.model.media.audio import decode_audio
from libs.model.media.limits import MediaLimits
from libs.model.types import MediaInput, Modality, ProcessorOptions
from tests.support.engines import Engines
from tests.support.media_set import video_bytes
from tests.support.parity import project_item

pytestmark = pytest.mark.integration

LIMITS = MediaLimits()


@pytest.mark.parametrize(
    ("data", "limits", "message"),
    [
        (synthetic.audio_bytes(0.1, seed=1, channels=20), LIMITS, "20 channels"),
        (synthetic.audio_bytes(31.0, seed=1, rate=8000), LIMITS, "31.0 s"),
        (
            synthetic.audio_bytes(0.1, seed=1, rate=96000),
            dataclasses.replace(LIMITS, max_audio_source_rate=48000),
            "96000 Hz",
        ),
    ],
    ids=["channels", "duration", "rate"],
)
def test_audio_over_a_limit_is_refused_from_its_header(data: bytes, limits: MediaLimits, message: str) -> None:
    with pytest.raises(MediaLimitError, match=message) as info:
        decode_audio(data, 16000, limits)
    assert info.value.field == "media.data"


def test_stereo_is_averaged_not_summed() -> None:
    # Both channels the same signal: the average is that signal (a sum would be twice as loud).
    mono = synthetic.audio_bytes(0.5, seed=3, rate=16000, channels=1)
    samples = decode_audio(mono, 16000, LIMITS)
    buf = io.BytesIO()
    sf.write(buf, np.stack([samples, samples], axis=1), 16000, format="WAV", subtype="FLOAT")
    assert np.array_equal(decode_audio(buf.getvalue(), 16000, LIMITS), samples)


def test_corrupt_audio_is_invalid() -> None:
    with pytest.raises(InvalidMediaError):
        decode_audio(b"RIFF" + bytes(60), 16000, LIMITS)


def test_a_container_libsndfile_cannot_read_is_decoded() -> None:
    samples = decode_audio(synthetic.m4a_bytes(1.0, seed=4), 16000, LIMITS)
    assert abs(samples.size - 16000) < 1024 and float(np.abs(samples).max()) > 0.1


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_a_one_frame_video_is_invalid(engines: Callable[[str], Engines], family: str) -> None:
    # Both video processors need a temporal patch of frames (the reference raises too).
    data = video_bytes(40, 40, frames=1, fps=Fraction(2), seed=1)
    with pytest.raises(InvalidMediaError):
        project_item(engines(family).encoder.adapter, Modality.VIDEO, data, ProcessorOptions())


def test_video_with_too_many_source_frames_is_refused(engines: Callable[[str], Engines]) -> None:
    adapter = engines("qwen3_vl").encoder.adapter
    media = MediaInput(Modality.VIDEO, video_bytes(16, 16, frames=30, fps=Fraction(30), seed=2))
    with pytest.raises(MediaLimitError, match="30 frames"):
        adapter.preprocess(media, media_hash(media), dataclasses.replace(LIMITS, max_video_source_frames=20))


def test_a_video_without_a_header_frame_count_is_counted(engines: Callable[[str], Engines]) -> None:
    """WebM carries no frame count (`stream.frames` is 0; the reference cannot sample it): the
    packets are counted instead, and sampling proceeds as for any clip of that length."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="webm") as container:
        stream = container.add_stream("libvpx", rate=4)
        stream.width, stream.height, stream.pix_fmt = 64, 32, "yuv420p"
        for i in range(8):
            frame = av.VideoFrame.from_ndarray(np.full((32, 64, 3), 30 * i, np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    with av.open(io.BytesIO(buf.getvalue())) as check:
        assert not check.streams.video[0].frames
    item = project_item(engines("qwen3_vl").encoder.adapter, Modality.VIDEO, buf.getvalue(), ProcessorOptions())
    assert item.layout.video is not None and item.layout.video.sampled_frames == 4  # 2 s at 2 fps
