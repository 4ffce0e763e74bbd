"""Negative controls, per family: the layout metadata and extra tensors matter. With them, staged
logits match generate(); with the grid swapped or dropped, the video timing changed, the rope delta
dropped, or (Qwen3-VL) the deepstack features dropped, they do not."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import DynamicCache

from libs.model.errors import EmbeddingMismatchError
from libs.model.types import ChatMessage, ChatRole, EncodedItem, EncodedPart, SamplingParams, TextPart, VideoLayout
from libs.runtime.decode_runner import DecodeRunner
from libs.runtime.prefill_runner import PrefillRunner
from tests.support.engines import FAMILIES, Engines
from tests.support.mixes import mixes
from tests.support.staged import reference_for, rel_diff
from tests.support.wire import layout_to_dict

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

MATCH, DIFFER = 1e-5, 1e-3
# Which video timing field each family's positions / prompt read.
USES_SECONDS_PER_GRID = {"qwen2_5_omni": True, "qwen2_5_vl": True, "qwen3_vl": False}


def _messages(items: list[EncodedItem], parts: tuple[str | int, ...]) -> list[ChatMessage]:
    return [
        ChatMessage(ChatRole.USER, tuple(TextPart(p) if isinstance(p, str) else EncodedPart(items[p]) for p in parts))
    ]


def _prefill_logits(
    prefill: PrefillRunner, messages: list[ChatMessage], *, sequential: bool = False, drop_extras: bool = False
) -> torch.Tensor:
    prompt = prefill.build(messages)
    with torch.inference_mode():
        embeds, positions, _, extras = prefill.inputs(prompt)
        if sequential:  # the grid dropped: positions as for plain text
            positions = torch.arange(embeds.shape[1]).view(1, 1, -1).expand(3, 1, -1)
        logits = prefill.runtime.adapter.lm_forward(
            prefill.runtime.module, embeds, positions, DynamicCache(), None, None if drop_extras else extras
        )
    return logits[0, -1].float()


def _case(eng: Engines, mix_name: str) -> dict[str, Any]:
    mix = next(m for m in mixes(eng.encoder.modalities) if m.name == mix_name)
    items = eng.encoder.encode(list(mix.media))
    layouts = [layout_to_dict(i.layout) for i in items]
    _, ref = reference_for(eng.reference, eng.runtime, eng.encoder.adapter, mix, layouts)
    return {"eng": eng, "mix": mix, "items": items, "ref": ref}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def images(family: str, engines: Callable[[str], Engines]) -> dict[str, Any]:
    return _case(engines(family), "two_images")


@pytest.fixture(scope="module")
def video(family: str, engines: Callable[[str], Engines]) -> dict[str, Any]:
    return _case(engines(family), "video")


def _logits(case: dict[str, Any], items: list[EncodedItem] | None = None, **kwargs: bool) -> torch.Tensor:
    return _prefill_logits(case["eng"].prefill, _messages(items or case["items"], case["mix"].parts), **kwargs)


def test_correct_metadata_matches(images: dict[str, Any], video: dict[str, Any]) -> None:
    assert rel_diff(_logits(images), images["ref"][0]) <= MATCH
    assert rel_diff(_logits(video), video["ref"][0]) <= MATCH


def test_swapped_grid_changes_logits(images: dict[str, Any]) -> None:
    item = images["items"][0]
    grid = item.layout.image
    assert grid is not None and grid.grid_h != grid.grid_w
    swapped = dataclasses.replace(grid, grid_h=grid.grid_w, grid_w=grid.grid_h)
    bad = [EncodedItem(dataclasses.replace(item.layout, image=swapped), item.tensors), images["items"][1]]
    assert rel_diff(_logits(images, bad), images["ref"][0]) > DIFFER


def test_dropped_grid_changes_logits(images: dict[str, Any], video: dict[str, Any]) -> None:
    assert rel_diff(_logits(images, sequential=True), images["ref"][0]) > DIFFER
    assert rel_diff(_logits(video, sequential=True), video["ref"][0]) > DIFFER


def _with_video(case: dict[str, Any], **changes: Any) -> list[EncodedItem]:
    (item,) = case["items"]
    assert item.layout.video is not None and item.layout.video.grid_t > 1
    timing: VideoLayout = dataclasses.replace(item.layout.video, **changes)
    return [EncodedItem(dataclasses.replace(item.layout, video=timing), item.tensors)]


def test_video_seconds_per_grid(family: str, video: dict[str, Any]) -> None:
    # Qwen2.5-VL / Omni place frames in time by seconds_per_grid; Qwen3-VL ignores it (timestamps instead).
    spg = video["items"][0].layout.video.seconds_per_grid
    diff = rel_diff(_logits(video, _with_video(video, seconds_per_grid=spg * 2)), video["ref"][0])
    assert diff > DIFFER if USES_SECONDS_PER_GRID[family] else diff <= MATCH


def test_video_timestamps(family: str, video: dict[str, Any]) -> None:
    # Qwen3-VL writes "<t seconds>" before each frame; the other families ignore grid_timestamps_s.
    stamps = video["items"][0].layout.video.grid_timestamps_s
    for changed in (tuple(t + 1.0 for t in stamps), tuple(0.0 for _ in stamps)):
        diff = rel_diff(_logits(video, _with_video(video, grid_timestamps_s=changed)), video["ref"][0])
        assert diff <= MATCH if USES_SECONDS_PER_GRID[family] else diff > DIFFER


def test_qwen3_vl_refuses_video_without_timestamps(engines: Callable[[str], Engines]) -> None:
    case = _case(engines("qwen3_vl"), "video")
    with pytest.raises(EmbeddingMismatchError):
        _logits(case, _with_video(case, grid_timestamps_s=()))


def test_qwen3_vl_deepstack_features_matter(engines: Callable[[str], Engines]) -> None:
    eng = engines("qwen3_vl")
    for case in (_case(eng, "two_images"), _case(eng, "video")):
        assert rel_diff(_logits(case), case["ref"][0]) <= MATCH
        assert rel_diff(_logits(case, drop_extras=True), case["ref"][0]) > DIFFER
        # Features of the wrong layer (swapped) do not pass either.
        swapped = [
            EncodedItem(
                i.layout,
                {**i.tensors, "deepstack.0": i.tensors["deepstack.1"], "deepstack.1": i.tensors["deepstack.0"]},
            )
            for i in case["items"]
        ]
        assert rel_diff(_logits(case, swapped), case["ref"][0]) > DIFFER


@pytest.mark.parametrize("drop_delta", [False, True])
def test_rope_delta_matters_in_decode(drop_delta: bool, images: dict[str, Any]) -> None:
    eng = images["eng"]
    result = eng.prefill.prefill(_messages(images["items"], images["mix"].parts), SamplingParams(max_tokens=4))
    assert result.kv_cache is not None and result.decode_state.rope_delta != 0
    state = dataclasses.replace(result.decode_state, rope_delta=0) if drop_delta else result.decode_state
    decode = DecodeRunner(eng.runtime)
    decode.add("r", result.kv_cache, state, SamplingParams(max_tokens=4))
    (_, logits) = decode.step(return_logits=True)["r"]
    decode.cancel("r")
    assert logits is not None
    if drop_delta:
        assert rel_diff(logits, images["ref"][1]) > DIFFER
    else:
        assert rel_diff(logits, images["ref"][1]) <= MATCH
