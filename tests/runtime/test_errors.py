"""Bad input becomes a typed EngineError (never a crash), with a kind the services map to a status."""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from libs.model.checkpoints import generate_checkpoint
from libs.model.errors import (
    CapacityError,
    EmbeddingMismatchError,
    ErrorKind,
    InvalidMediaError,
    InvalidRequestError,
    KvMismatchError,
    MediaLimitError,
    UnsupportedModalityError,
)
from libs.model.media import synthetic
from libs.model.media.limits import MediaLimits
from libs.model.types import (
    ChatMessage,
    ChatRole,
    EncodedItem,
    EncodedPart,
    MediaInput,
    Modality,
    ProcessorOptions,
    SamplingParams,
    TextPart,
)
from libs.runtime.decode_runner import DecodeRunner
from libs.runtime.encoder_runner import EncoderRunner
from libs.runtime.lm_runtime import LanguageModelRuntime
from libs.runtime.prefill_runner import PrefillRunner
from tests.support.engines import FAMILIES, Engines

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _encoder_with(encoder: EncoderRunner, limits: MediaLimits) -> EncoderRunner:
    clone = object.__new__(EncoderRunner)
    clone.__dict__.update(encoder.__dict__)
    clone.limits = limits
    return clone


@pytest.mark.parametrize("modality", list(Modality))
def test_corrupt_media(omni_encoder: EncoderRunner, modality: Modality) -> None:
    with pytest.raises(InvalidMediaError) as err:
        omni_encoder.encode([MediaInput(modality, b"\x89PNG\r\n\x1a\n this is not media" * 10)])
    assert err.value.kind is ErrorKind.INVALID_ARGUMENT and err.value.field == "media.data"


def test_truncated_png(omni_encoder: EncoderRunner) -> None:
    data = synthetic.png_bytes(64, 64, seed=0)
    with pytest.raises(InvalidMediaError):
        omni_encoder.encode([MediaInput(Modality.IMAGE, data[: len(data) // 2])])


@pytest.mark.parametrize("side", [7000, 10000, 20000])  # 49 Mpixel (ours only), 100 and 400 (Pillow's guard too)
def test_decompression_bomb_refused_before_decoding(omni_encoder: EncoderRunner, side: int) -> None:
    buf = io.BytesIO()
    Image.new("1", (side, side)).save(buf, format="PNG")  # tens of KB, a canvas of side² pixels
    assert len(buf.getvalue()) < 100_000
    with pytest.raises(MediaLimitError, match=r"limit 40000000 \(refused from its header") as err:
        omni_encoder.encode([MediaInput(Modality.IMAGE, buf.getvalue())])
    assert str(side * side) in str(err.value) or f"{side}x{side}" in str(err.value)


def test_requested_pixels_over_limit(omni_encoder: EncoderRunner) -> None:
    media = MediaInput(Modality.IMAGE, synthetic.png_bytes(56, 56, seed=0), options=ProcessorOptions(max_pixels=10**9))
    with pytest.raises(MediaLimitError) as err:
        omni_encoder.encode([media])
    assert err.value.field == "processor_options.max_pixels"


def test_too_many_frames(omni_encoder: EncoderRunner) -> None:
    video = synthetic.video_bytes(56, 56, frames=4, fps=2, seed=0)
    runner = _encoder_with(omni_encoder, MediaLimits(max_video_frames=16))
    with pytest.raises(MediaLimitError):
        runner.encode([MediaInput(Modality.VIDEO, video, options=ProcessorOptions(video_max_frames=64))])


def test_video_too_long(omni_encoder: EncoderRunner) -> None:
    video = synthetic.video_bytes(56, 56, frames=8, fps=2, seed=0)  # 4 s
    with pytest.raises(MediaLimitError):
        _encoder_with(omni_encoder, MediaLimits(max_video_seconds=2.0)).encode([MediaInput(Modality.VIDEO, video)])


def test_audio_too_long(omni_encoder: EncoderRunner) -> None:
    audio = synthetic.wav_bytes(1.5, seed=0)
    with pytest.raises(MediaLimitError):
        _encoder_with(omni_encoder, MediaLimits(max_audio_seconds=1.0)).encode([MediaInput(Modality.AUDIO, audio)])


def test_media_bytes_over_limit(omni_encoder: EncoderRunner) -> None:
    data = synthetic.png_bytes(64, 64, seed=0)
    with pytest.raises(MediaLimitError):
        _encoder_with(omni_encoder, MediaLimits(max_media_bytes=100)).encode([MediaInput(Modality.IMAGE, data)])


def test_modality_the_model_lacks(omni_encoder: EncoderRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(omni_encoder.adapter, "modalities", frozenset({Modality.IMAGE}))
    with pytest.raises(UnsupportedModalityError) as err:
        omni_encoder.encode([MediaInput(Modality.AUDIO, synthetic.wav_bytes(0.5, seed=0))])
    assert err.value.field == "items[0].media.modality"


@pytest.fixture(scope="module")
def image_item(omni_encoder: EncoderRunner) -> EncodedItem:
    (item,) = omni_encoder.encode([MediaInput(Modality.IMAGE, synthetic.png_bytes(56, 56, seed=0))])
    return item


def _ask(item: EncodedItem) -> list[ChatMessage]:
    return [ChatMessage(ChatRole.USER, (EncodedPart(item), TextPart("what is it")))]


@pytest.mark.parametrize(
    "tensors",
    [
        lambda e: {"embeddings": e[:-1]},  # fewer rows than placeholders
        lambda e: {"embeddings": torch.cat([e, e], dim=1)},  # wrong width
        lambda e: {"embeddings": e.long()},  # not floating point
        lambda e: {},  # missing
        lambda e: {"embeddings": e, "deepstack.0": e},  # extra tensor the spec does not list
    ],
)
def test_embeddings_not_matching_layout(omni_prefill: PrefillRunner, image_item: EncodedItem, tensors: Any) -> None:
    bad = EncodedItem(image_item.layout, tensors(image_item.embeddings))
    with pytest.raises(EmbeddingMismatchError):
        omni_prefill.prefill(_ask(bad), SamplingParams(max_tokens=2))


def test_layout_arm_not_matching_modality(omni_prefill: PrefillRunner, image_item: EncodedItem) -> None:
    layout = dataclasses.replace(image_item.layout, modality=Modality.VIDEO)
    with pytest.raises(EmbeddingMismatchError):
        omni_prefill.prefill(_ask(EncodedItem(layout, image_item.tensors)), SamplingParams())


def test_placeholder_text_injection_refused(omni_prefill: PrefillRunner) -> None:
    with pytest.raises(InvalidRequestError):
        omni_prefill.prefill([ChatMessage(ChatRole.USER, (TextPart("hi <|IMAGE|>"),))], SamplingParams())


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(temperature=-1), SamplingParams(top_p=0), SamplingParams(top_k=-2), SamplingParams(stop=("",))],
)
def test_bad_sampling(omni_prefill: PrefillRunner, sampling: SamplingParams) -> None:
    with pytest.raises(InvalidRequestError):
        omni_prefill.prefill([ChatMessage(ChatRole.USER, (TextPart("hi"),))], sampling)


@pytest.fixture(scope="module")
def other_model(tmp_path_factory: pytest.TempPathFactory) -> LanguageModelRuntime:
    path = generate_checkpoint("qwen2_5_omni", "tiny", tmp_path_factory.mktemp("models") / "other", seed=1)
    return LanguageModelRuntime(path)


def test_kv_from_a_different_model(other_model: LanguageModelRuntime, omni_decode: DecodeRunner) -> None:
    result = PrefillRunner(other_model).prefill(
        [ChatMessage(ChatRole.USER, (TextPart("hello"),))], SamplingParams(max_tokens=4)
    )
    assert result.kv_cache is not None
    # Same shapes, different weights: only the identity tells them apart.
    assert result.kv_cache.layout == omni_decode.runtime.kv_layout(result.kv_cache.layout.num_tokens)
    with pytest.raises(KvMismatchError) as err:
        omni_decode.add("x", result.kv_cache, result.decode_state, SamplingParams(max_tokens=4))
    assert err.value.kind is ErrorKind.FAILED_PRECONDITION


def test_kv_mis_shaped(omni_prefill: PrefillRunner, omni_decode: DecodeRunner) -> None:
    result = omni_prefill.prefill([ChatMessage(ChatRole.USER, (TextPart("hello"),))], SamplingParams(max_tokens=4))
    assert result.kv_cache is not None
    kv = result.kv_cache
    kv.tensors["layers.0.key"] = kv.tensors["layers.0.key"][:, :-1]
    with pytest.raises(KvMismatchError):
        omni_decode.add("x", kv, result.decode_state, SamplingParams(max_tokens=4))
    assert omni_decode.active_ids == []


def test_decode_batch_capacity(omni_prefill: PrefillRunner, omni_runtime: LanguageModelRuntime) -> None:
    decode = DecodeRunner(omni_runtime, max_batch=1)
    result = omni_prefill.prefill([ChatMessage(ChatRole.USER, (TextPart("hello"),))], SamplingParams(max_tokens=4))
    assert result.kv_cache is not None
    decode.add("a", result.kv_cache, result.decode_state, SamplingParams(max_tokens=4))
    with pytest.raises(CapacityError) as err:
        decode.add("b", result.kv_cache, result.decode_state, SamplingParams(max_tokens=4))
    assert err.value.kind is ErrorKind.RESOURCE_EXHAUSTED


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_is_deterministic(family: str, engines: Callable[[str], Engines], tmp_path: Path) -> None:
    again = generate_checkpoint(family, "tiny", tmp_path / "again", seed=0)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "chat_template.jinja"):
        assert (again / name).read_bytes() == (engines(family).path / name).read_bytes(), name


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_vl_grid_must_fit_placeholder_count(family: str, engines: Callable[[str], Engines]) -> None:
    eng = engines(family)
    (item,) = eng.encoder.encode([MediaInput(Modality.IMAGE, synthetic.png_bytes(56, 56, seed=0))])
    assert item.layout.image is not None
    wider = dataclasses.replace(item.layout.image, grid_w=item.layout.image.grid_w * 2)
    bad = EncodedItem(dataclasses.replace(item.layout, image=wider), item.tensors)
    with pytest.raises(EmbeddingMismatchError) as err:
        eng.prefill.prefill(_ask(bad), SamplingParams(max_tokens=2))
    assert err.value.field == "layout.detail"


def test_qwen3_vl_needs_every_deepstack_tensor(engines: Callable[[str], Engines]) -> None:
    eng = engines("qwen3_vl")
    (item,) = eng.encoder.encode([MediaInput(Modality.IMAGE, synthetic.png_bytes(56, 56, seed=0))])
    assert sorted(item.tensors) == ["deepstack.0", "deepstack.1", "embeddings"]
    for bad in (
        {k: v for k, v in item.tensors.items() if k != "deepstack.1"},  # missing
        {**item.tensors, "deepstack.0": item.tensors["deepstack.0"][:-1]},  # rows do not fit
    ):
        with pytest.raises(EmbeddingMismatchError):
            eng.prefill.prefill(_ask(EncodedItem(item.layout, bad)), SamplingParams(max_tokens=2))
