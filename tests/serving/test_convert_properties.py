"""Properties of the wire <-> engine conversions (libs/serving/convert.py), checked by Hypothesis
on generated values rather than a handful of examples:

- layouts, KV layouts and decode states survive engine -> wire -> engine unchanged (and the
  reverse), whatever their values;
- what the contract's validator accepts, the engine accepts: a wire layout that passes
  `validate_item_layout` converts to an engine layout whose own `check()` passes, so a validated
  request never ends as an INTERNAL error deeper in;
- sampling parameters that pass validation map field for field (floats at the wire's float32);
- a conversation's media parts are replaced by the encoded items in prompt order, text untouched.
"""

from __future__ import annotations

import math
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libs.contract.epd.v1 import chat_pb2, layout_pb2, media_pb2, prefill_pb2, sampling_pb2
from libs.contract.errors import InvalidArgument
from libs.contract.validation import DEFAULT_LIMITS, validate_item_layout, validate_sampling
from libs.model import types as eng
from libs.serving import convert

pytestmark = pytest.mark.unit

settings.register_profile("epd", deadline=None, max_examples=100)
settings.load_profile("epd")

_U31 = st.integers(min_value=0, max_value=2**31 - 1)
_POS = st.integers(min_value=1, max_value=4096)
_SECONDS = st.floats(min_value=0, max_value=1e6, allow_nan=False, allow_infinity=False)
_HASH = st.text(alphabet="0123456789abcdef", min_size=1, max_size=64)


@st.composite
def engine_layouts(draw: st.DrawFn) -> eng.ItemLayout:
    modality = draw(st.sampled_from(list(eng.Modality)))
    count = draw(_POS)
    image = video = audio = None
    if modality is eng.Modality.IMAGE:
        image = eng.ImageLayout(draw(_POS), draw(_POS), draw(_POS))
    elif modality is eng.Modality.VIDEO:
        grid_t = draw(st.integers(min_value=1, max_value=16))
        stamps = tuple(sorted(draw(st.lists(_SECONDS, min_size=grid_t, max_size=grid_t))))
        video = eng.VideoLayout(grid_t, draw(_POS), draw(_POS), draw(_SECONDS), stamps, draw(_U31))
    elif draw(st.booleans()):
        audio = eng.AudioLayout(draw(_POS), count, draw(_SECONDS))
    else:  # contract 1.4: one window of an encoder-decoder speech model, cross-attended to
        clip = draw(_POS)
        start = draw(st.integers(min_value=0, max_value=clip - 1))
        frames = draw(st.integers(min_value=1, max_value=clip - start))
        audio = eng.AudioLayout(draw(_POS), count, draw(_SECONDS), start, frames, clip)
        return eng.ItemLayout(modality, draw(_U31), draw(_HASH), 0, audio=audio, cross_attention_rows=count)
    return eng.ItemLayout(modality, draw(_U31), draw(_HASH), count, image=image, video=video, audio=audio)


@given(engine_layouts())
def test_item_layout_round_trips_through_the_wire(layout: eng.ItemLayout) -> None:
    wire = convert.item_layout_to_wire(layout)
    assert convert.item_layout_to_engine(layout_pb2.ItemLayout.FromString(wire.SerializeToString())) == layout


@given(engine_layouts())
def test_engine_layouts_pass_the_contract_validator(layout: eng.ItemLayout) -> None:
    validate_item_layout(convert.item_layout_to_wire(layout), "layout", DEFAULT_LIMITS)


@st.composite
def wire_layouts(draw: st.DrawFn) -> layout_pb2.ItemLayout:
    """Arbitrary (mostly invalid) wire layouts: any modality number, arm, counts and floats."""
    layout = layout_pb2.ItemLayout(
        modality=draw(st.integers(min_value=0, max_value=4)),
        item_index=draw(_U31),
        mm_hash=draw(st.text(max_size=8)),
        placeholder_token_count=draw(st.integers(min_value=-2, max_value=70000)),
        cross_attention_rows=draw(st.sampled_from([0, 0, -1, 1, 1500, 70000])),
    )
    floats = st.floats(allow_nan=True, allow_infinity=True, width=64)
    arm = draw(st.sampled_from(["none", "image", "video", "audio"]))
    ints = st.integers(min_value=-2, max_value=5000)
    if arm == "image":
        layout.image.CopyFrom(layout_pb2.ImageLayout(grid_t=draw(ints), grid_h=draw(ints), grid_w=draw(ints)))
    elif arm == "video":
        layout.video.CopyFrom(
            layout_pb2.VideoLayout(
                grid_t=draw(ints),
                grid_h=draw(ints),
                grid_w=draw(ints),
                seconds_per_grid=draw(floats),
                grid_timestamps_s=draw(st.lists(floats, max_size=5)),
                sampled_frames=draw(ints),
            )
        )
    elif arm == "audio":
        layout.audio.CopyFrom(
            layout_pb2.AudioLayout(
                feature_length=draw(ints),
                output_length=draw(ints),
                duration_s=draw(floats),
                window_start_frame=draw(ints),
                window_frames=draw(ints),
                clip_frames=draw(ints),
            )
        )
    return layout


@given(wire_layouts())
def test_what_the_validator_accepts_the_engine_accepts(layout: layout_pb2.ItemLayout) -> None:
    try:
        validate_item_layout(layout, "layout", DEFAULT_LIMITS)
    except InvalidArgument:
        return
    converted = convert.item_layout_to_engine(layout)
    converted.check()
    assert convert.item_layout_to_wire(converted) == layout


@given(
    st.builds(
        eng.KvCacheLayout,
        num_layers=_POS,
        num_kv_heads=_POS,
        head_dim=_POS,
        num_tokens=_U31,
        dtype=st.sampled_from(sorted(convert.DTYPE_TO_WIRE)),
        cross_tokens=_U31,
    )
)
def test_kv_layout_round_trips(layout: eng.KvCacheLayout) -> None:
    wire = prefill_pb2.KvCacheLayout.FromString(convert.kv_layout_to_wire(layout).SerializeToString())
    assert convert.kv_layout_to_engine(wire) == layout


@given(
    st.builds(
        eng.DecodeState,
        next_input_token_id=_U31,
        rope_delta=st.integers(min_value=-(2**31), max_value=2**31 - 1),
        generated_tokens=_U31,
        generated_text=st.text(),
        prompt_tokens=_U31,
    )
)
def test_decode_state_round_trips(state: eng.DecodeState) -> None:
    wire = prefill_pb2.DecodeState.FromString(convert.decode_state_to_wire(state).SerializeToString())
    assert convert.decode_state_to_engine(wire) == state


def _f32(value: float) -> float:
    return float(struct.unpack("<f", struct.pack("<f", value))[0])


@given(
    temperature=st.floats(min_value=0, max_value=100, width=32),
    top_p=st.none() | st.floats(min_value=0, max_value=1, width=32, exclude_min=True),
    top_k=st.integers(min_value=0, max_value=1000),
    seed=st.none() | st.integers(min_value=0, max_value=2**64 - 1),
    max_tokens=st.integers(min_value=0, max_value=DEFAULT_LIMITS.max_tokens),
    stop=st.lists(st.text(min_size=1, max_size=8), max_size=4),
    stop_token_ids=st.lists(_U31, max_size=4),
    timestamps=st.booleans(),
)
def test_valid_sampling_maps_field_for_field(
    temperature: float,
    top_p: float | None,
    top_k: int,
    seed: int | None,
    max_tokens: int,
    stop: list[str],
    stop_token_ids: list[int],
    timestamps: bool,
) -> None:
    wire = sampling_pb2.SamplingParams(
        temperature=temperature,
        top_k=top_k,
        max_tokens=max_tokens,
        stop=stop,
        stop_token_ids=stop_token_ids,
        timestamps=timestamps,
    )
    if top_p is not None:
        wire.top_p = top_p
    if seed is not None:
        wire.seed = seed
    validate_sampling(wire, "sampling", DEFAULT_LIMITS)
    params = convert.sampling_to_engine(sampling_pb2.SamplingParams.FromString(wire.SerializeToString()))
    assert params.temperature == _f32(temperature)
    assert params.top_p == (1.0 if top_p is None else _f32(top_p))
    assert math.isfinite(params.temperature) and 0 < params.top_p <= 1
    assert (params.top_k, params.seed, params.max_tokens) == (top_k, seed, max_tokens)
    assert (params.stop, params.stop_token_ids) == (tuple(stop), tuple(stop_token_ids))
    assert params.timestamps is timestamps


@given(st.lists(st.one_of(st.text(max_size=10), st.none()), min_size=1, max_size=8), engine_layouts())
def test_media_parts_become_the_encoded_items_in_prompt_order(parts: list[str | None], layout: eng.ItemLayout) -> None:
    message = chat_pb2.ChatMessage(role=chat_pb2.CHAT_ROLE_USER)
    for part in parts:
        if part is None:
            message.parts.add().media.CopyFrom(media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=b"x"))
        else:
            message.parts.add().text = part
    items = [eng.EncodedItem(layout, {}) for _ in parts if _ is None]
    (converted,) = convert.messages_to_engine([message], items)
    assert converted.role is eng.ChatRole.USER
    media = iter(items)
    for part, out in zip(parts, converted.parts, strict=True):
        if part is None:
            assert isinstance(out, eng.EncodedPart) and out.item is next(media)
        else:
            assert out == eng.TextPart(part)
    assert len(convert.media_parts([message])) == len(items)
