"""Negative controls: the layout metadata matters. With it, staged logits match generate(); with the
grid swapped or dropped, the video timing changed, or the rope delta dropped, they do not."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from transformers import DynamicCache

from libs.engine.decode_runner import DecodeRunner
from libs.engine.encoder_runner import EncoderRunner
from libs.engine.prefill_runner import PrefillRunner
from libs.engine.types import ChatMessage, ChatRole, EncodedItem, EncodedPart, SamplingParams, TextPart
from tests.engine.mixes import mixes
from tests.engine.staged import reference_for, rel_diff
from tests.engine.wire import layout_to_dict

pytestmark = pytest.mark.timeout(120)


def _messages(items: list[EncodedItem], parts: tuple[str | int, ...]) -> list[ChatMessage]:
    return [
        ChatMessage(ChatRole.USER, tuple(TextPart(p) if isinstance(p, str) else EncodedPart(items[p]) for p in parts))
    ]


def _prefill_logits(prefill: PrefillRunner, messages: list[ChatMessage], *, sequential: bool = False) -> torch.Tensor:
    prompt = prefill.build(messages)
    with torch.inference_mode():
        embeds, positions, _, extras = prefill.inputs(prompt)
        if sequential:  # the grid dropped: positions as for plain text
            positions = torch.arange(embeds.shape[1]).view(1, 1, -1).expand(3, 1, -1)
        logits = prefill.runtime.adapter.lm_forward(
            prefill.runtime.module, embeds, positions, DynamicCache(), None, extras
        )
    return logits[0, -1].float()


@pytest.fixture(scope="module")
def case(omni_encoder: EncoderRunner, omni_runtime: Any, omni_reference: Any) -> dict[str, Any]:
    mix = next(m for m in mixes(omni_encoder.modalities) if m.name == "two_images")
    items = omni_encoder.encode(list(mix.media))
    _, ref_logits = reference_for(
        omni_reference, omni_runtime, omni_encoder.adapter, mix, [layout_to_dict(i.layout) for i in items]
    )
    return {"mix": mix, "items": items, "ref": ref_logits}


def test_correct_metadata_matches(case: dict[str, Any], omni_prefill: PrefillRunner) -> None:
    logits = _prefill_logits(omni_prefill, _messages(case["items"], case["mix"].parts))
    assert rel_diff(logits, case["ref"][0]) <= 1e-5


def test_swapped_grid_changes_logits(case: dict[str, Any], omni_prefill: PrefillRunner) -> None:
    item = case["items"][0]
    grid = item.layout.image
    assert grid is not None and grid.grid_h != grid.grid_w
    swapped = dataclasses.replace(grid, grid_h=grid.grid_w, grid_w=grid.grid_h)
    bad = [EncodedItem(dataclasses.replace(item.layout, image=swapped), item.tensors), case["items"][1]]
    logits = _prefill_logits(omni_prefill, _messages(bad, case["mix"].parts))
    assert rel_diff(logits, case["ref"][0]) > 1e-3


def test_dropped_grid_changes_logits(case: dict[str, Any], omni_prefill: PrefillRunner) -> None:
    logits = _prefill_logits(omni_prefill, _messages(case["items"], case["mix"].parts), sequential=True)
    assert rel_diff(logits, case["ref"][0]) > 1e-3


def test_video_timing_changes_logits(
    omni_encoder: EncoderRunner, omni_runtime: Any, omni_reference: Any, omni_prefill: PrefillRunner
) -> None:
    mix = next(m for m in mixes(omni_encoder.modalities) if m.name == "video")
    (item,) = omni_encoder.encode(list(mix.media))
    _, ref = reference_for(omni_reference, omni_runtime, omni_encoder.adapter, mix, [layout_to_dict(item.layout)])
    assert rel_diff(_prefill_logits(omni_prefill, _messages([item], mix.parts)), ref[0]) <= 1e-5
    assert item.layout.video is not None and item.layout.video.grid_t > 1
    slower = dataclasses.replace(item.layout.video, seconds_per_grid=item.layout.video.seconds_per_grid * 2)
    bad = EncodedItem(dataclasses.replace(item.layout, video=slower), item.tensors)
    assert rel_diff(_prefill_logits(omni_prefill, _messages([bad], mix.parts)), ref[0]) > 1e-3


@pytest.mark.parametrize("drop_delta", [False, True])
def test_rope_delta_matters_in_decode(
    drop_delta: bool, case: dict[str, Any], omni_prefill: PrefillRunner, omni_decode: DecodeRunner
) -> None:
    result = omni_prefill.prefill(_messages(case["items"], case["mix"].parts), SamplingParams(max_tokens=4))
    assert result.kv_cache is not None and result.decode_state.rope_delta != 0
    state = dataclasses.replace(result.decode_state, rope_delta=0) if drop_delta else result.decode_state
    omni_decode.add("r", result.kv_cache, state, SamplingParams(max_tokens=4))
    (_, logits) = omni_decode.step(return_logits=True)["r"]
    assert logits is not None
    if drop_delta:
        assert rel_diff(logits, case["ref"][1]) > 1e-3
    else:
        assert rel_diff(logits, case["ref"][1]) <= 1e-5
