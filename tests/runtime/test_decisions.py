"""Where the references disagree, the project follows the documented decision (docs/runtime.md,
"Preprocessing decisions"); each test shows the disagreement is real and which side we take."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from libs.model.prompt import build_prompt
from libs.model.types import ChatMessage, ChatRole, EncodedPart, TextPart
from tests.support.engines import Engines
from tests.support.mixes import Mix, mixes
from tests.support.reference import reference_inputs

pytestmark = pytest.mark.integration


def _mix(name: str) -> Mix:
    return next(m for m in mixes(frozenset()) if m.name == name)


def test_qwen2_5_vl_text_after_a_long_video_resumes_after_its_last_frame(engines: Callable[[str], Engines]) -> None:
    eng = engines("qwen2_5_vl")
    mix = _mix("video_capped")
    (item,) = eng.encoder.encode(list(mix.media))
    video = item.layout.video
    assert video is not None and video.grid_t == 4 and abs(video.seconds_per_grid - 2.5) < 1e-6
    parts = tuple(TextPart(p) if isinstance(p, str) else EncodedPart(item) for p in mix.parts)
    prompt = build_prompt(eng.runtime.tokenizer, eng.runtime.adapter, [ChatMessage(ChatRole.USER, parts)])
    ours, _ = eng.runtime.adapter.position_ids(prompt.input_ids, prompt.items)

    kwargs = reference_inputs(eng.path, mix)
    inner = eng.reference.model
    args = dict(
        mm_token_type_ids=kwargs["mm_token_type_ids"],
        video_grid_thw=kwargs["video_grid_thw"],
        second_per_grid_ts=kwargs["second_per_grid_ts"],
    )
    trained, _ = inner.get_rope_index(kwargs["input_ids"], **args)  # the reference's, as loaded
    transformers_5, _ = type(inner).get_rope_index(inner, kwargs["input_ids"], **args)
    assert torch.equal(ours, trained[:, 0])

    start = prompt.items[0].start
    after = start + prompt.items[0].layout.placeholder_token_count  # first text position after the video
    merged_side = max(video.grid_h, video.grid_w) // 2
    # Temporal positions reach 3 patches x 2.5 s x 2 tokens/s = 15: text resumes at 16, not at the
    # spatial extent (transformers 5.x).
    assert int(ours[0, after]) - int(ours[0, start]) == 16
    assert int(transformers_5[0, 0, after]) - int(transformers_5[0, 0, start]) == merged_side
    assert merged_side < 16


def test_omni_seconds_per_grid_is_the_processors_not_the_frame_span(engines: Callable[[str], Engines]) -> None:
    """Qwen2.5-Omni: temporal patch / requested fps, even when max_frames spreads the frames wider."""
    eng = engines("qwen2_5_omni")
    mix = _mix("video_capped")
    (item,) = eng.encoder.encode(list(mix.media))
    video = item.layout.video
    assert video is not None
    span = video.grid_timestamps_s[1] - video.grid_timestamps_s[0]  # what one temporal patch covers
    assert abs(span - 2.5) < 1e-9 and video.seconds_per_grid == 1.0
    reference = reference_inputs(eng.path, mix)["video_second_per_grid"]
    assert float(torch.as_tensor(reference)[0]) == video.seconds_per_grid
