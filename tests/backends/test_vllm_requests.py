"""The vLLM request planner (no vLLM needed): what would kill a vLLM engine is refused with
INVALID_ARGUMENT naming the field; a valid conversation becomes a prompt with one placeholder per
item, layout metadata only, items named by their content within the tenant. Its live counterpart is
test_vllm_pd.py (the same requests through a real vLLM engine)."""

from __future__ import annotations

from pathlib import Path

import pytest

from libs.backends.vllm.requests import RequestPlanner
from libs.contract.epd.v1 import chat_pb2, layout_pb2, media_pb2, tensor_pb2
from libs.contract.errors import InvalidArgument
from libs.model import content
from libs.model import types as eng
from libs.model.checkpoints import ensure_checkpoint

pytestmark = pytest.mark.integration

SAMPLING = eng.SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def planner(omni_tiny: Path) -> RequestPlanner:
    return RequestPlanner(omni_tiny, max_model_len=512)


def _handle(rows: int, width: int = 64, lease: str = "lease-1") -> tensor_pb2.TensorHandle:
    spec = tensor_pb2.TensorSpec(
        shape=[rows, width], dtype=tensor_pb2.D_TYPE_FLOAT32, nbytes=rows * width * 4,
        layout=tensor_pb2.TENSOR_LAYOUT_ROW_MAJOR,
    )  # fmt: skip
    return tensor_pb2.TensorHandle(
        transport=tensor_pb2.TRANSPORT_KIND_NIXL,
        agent=tensor_pb2.NixlAgentRef(agent_name="enc-a", instance_id="i1", producer_address="127.0.0.1:1"),
        lease_id=lease,
        tensors=[tensor_pb2.TensorDescriptor(name="embeddings", spec=spec)],
    )


def _image(grid: tuple[int, int, int] = (1, 4, 6), rows: int = 6, lease: str = "lease-1") -> layout_pb2.EncodedMedia:
    t, h, w = grid
    return layout_pb2.EncodedMedia(
        layout=layout_pb2.ItemLayout(
            modality=media_pb2.MODALITY_IMAGE, mm_hash="h" * 64, placeholder_token_count=rows,
            image=layout_pb2.ImageLayout(grid_t=t, grid_h=h, grid_w=w),
        ),
        embeddings=_handle(rows, lease=lease),
    )  # fmt: skip


def _audio(feature_length: int, rows: int) -> layout_pb2.EncodedMedia:
    return layout_pb2.EncodedMedia(
        layout=layout_pb2.ItemLayout(
            modality=media_pb2.MODALITY_AUDIO, mm_hash="a" * 64, placeholder_token_count=rows,
            audio=layout_pb2.AudioLayout(feature_length=feature_length, output_length=rows, duration_s=2.0),
        ),
        embeddings=_handle(rows, lease="lease-a"),
    )  # fmt: skip


def _video(
    seconds_per_grid: float, handle: tensor_pb2.TensorHandle, timestamps: tuple[float, ...] = ()
) -> layout_pb2.EncodedMedia:
    # grid 2x4x6, merge 2: 12 rows
    return layout_pb2.EncodedMedia(
        layout=layout_pb2.ItemLayout(
            modality=media_pb2.MODALITY_VIDEO, mm_hash="v" * 64, placeholder_token_count=12,
            video=layout_pb2.VideoLayout(grid_t=2, grid_h=4, grid_w=6, seconds_per_grid=seconds_per_grid,
                                         grid_timestamps_s=timestamps, sampled_frames=4),
        ),
        embeddings=handle,
    )  # fmt: skip


def _messages(*encoded: layout_pb2.EncodedMedia, text: str = "Describe it.") -> list[chat_pb2.ChatMessage]:
    parts = [chat_pb2.ContentPart(encoded=e) for e in encoded] + [chat_pb2.ContentPart(text=text)]
    return [chat_pb2.ChatMessage(role=chat_pb2.CHAT_ROLE_USER, parts=parts)]


def _plan(planner: RequestPlanner, *encoded: layout_pb2.EncodedMedia, text: str = "Describe it.") -> object:
    return planner.plan("r1", _messages(*encoded, text=text), SAMPLING)


def test_a_valid_conversation_becomes_metadata_and_item_ids(planner: RequestPlanner) -> None:
    first, second = _image(), _image(grid=(1, 4, 4), rows=4, lease="lease-2")
    planned = planner.plan("r1", _messages(first, second), SAMPLING)
    image_id = planner.tokenizer.convert_tokens_to_ids("<|IMAGE|>")
    assert planned.prompt["prompt_token_ids"].count(image_id) == 2  # one placeholder per item
    assert planned.prompt["multi_modal_data"]["image"]["image_grid_thw"].tolist() == [[1, 4, 6], [1, 4, 4]]
    uuids = planned.prompt["multi_modal_uuids"]["image"]
    assert uuids == ["h" * 64, "h" * 64]  # named by content: the same item's entries are shared
    assert planned.uuids == uuids  # in item order: the service reads them and says where each lies
    salted = planner.plan("r2", _messages(first, second), SAMPLING, cache_salt="tenant-a")
    assert salted.uuids == [content.scoped("h" * 64, "tenant-a")] * 2 != uuids  # within its tenant only
    assert planned.prompt_tokens == len(planned.prompt["prompt_token_ids"]) - 2 + 10


def test_audio_metadata_is_its_feature_length(planner: RequestPlanner) -> None:
    planned = _plan(planner, _audio(200, 50))
    assert planned.prompt["multi_modal_data"]["audio"]["audio_feature_lengths"].tolist() == [200]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("encoded", "text", "field"),
    [
        (None, "look: <|IMAGE|>", "messages[0].parts[0].text"),
        (_image(grid=(1, 4, 8)), "x", "items[0].layout.placeholder_token_count"),  # grid gives 8 rows, not 6
        (_image(grid=(1, 3, 8)), "x", "items[0].layout.placeholder_token_count"),  # h not a merge multiple
        (_audio(200, 49), "x", "items[0].layout.placeholder_token_count"),
    ],
)
def test_inputs_that_would_kill_the_engine_are_refused(
    planner: RequestPlanner, encoded: layout_pb2.EncodedMedia | None, text: str, field: str
) -> None:
    with pytest.raises(InvalidArgument) as err:
        _plan(planner, *([encoded] if encoded is not None else []), text=text)
    assert err.value.field == field


def test_handles_must_carry_what_the_model_consumes(planner: RequestPlanner) -> None:
    narrow = _image()
    narrow.embeddings.tensors[0].spec.shape[1] = 32
    with pytest.raises(InvalidArgument) as err:
        _plan(planner, narrow)
    assert err.value.field == "items[0].embeddings.tensors" and "[6, 64]" in str(err.value)
    inline = _image()
    inline.embeddings.transport = tensor_pb2.TRANSPORT_KIND_INLINE
    with pytest.raises(InvalidArgument) as err:
        _plan(planner, inline)
    assert err.value.field == "items[0].embeddings.transport"


def test_prompt_plus_max_tokens_must_fit_the_model_length(planner: RequestPlanner) -> None:
    with pytest.raises(InvalidArgument) as err:
        planner.plan("r", _messages(), eng.SamplingParams(max_tokens=600))
    assert err.value.field == "sampling.max_tokens"


def test_a_videos_temporal_step_is_the_layouts(planner: RequestPlanner) -> None:
    """Sampled at 4 fps a temporal patch spans 0.5 s: vLLM's M-RoPE gets it, not its 1.0 default
    (libs/backends/vllm/video_decisions.py; the engine side: test_video_decisions.py)."""
    planned = _plan(planner, _video(0.5, _handle(12, lease="lease-v")))
    video = planned.prompt["multi_modal_data"]["video"]  # type: ignore[attr-defined]
    assert video["video_grid_thw"].tolist() == [[2, 4, 6]]
    assert video["second_per_grid_ts"].tolist() == [0.5]


def test_a_qwen3_vl_video_has_no_outer_markers() -> None:
    """The project's Qwen3-VL video is the per-patch sequence alone; vLLM expands the bare
    placeholder into it, so the template's `<|vision_start|>`/`<|vision_end|>` around it go."""
    planner = RequestPlanner(ensure_checkpoint("qwen3_vl", "tiny"), max_model_len=512)
    (spec,) = [s for s in planner.expected_specs() if s.modality is eng.Modality.VIDEO]
    handle = _handle(12, width=spec.width, lease="lease-v")
    for extra in spec.extra_tensors:
        descriptor = tensor_pb2.TensorDescriptor()
        descriptor.CopyFrom(handle.tensors[0])
        descriptor.name = extra.name
        descriptor.spec.shape[1] = extra.width
        handle.tensors.append(descriptor)
    planned = _plan(planner, _video(1.0, handle, timestamps=(0.25, 1.25)))
    ids = planned.prompt["prompt_token_ids"]  # type: ignore[attr-defined]
    to_id = planner.tokenizer.convert_tokens_to_ids
    video, start, end = to_id("<|video_pad|>"), to_id("<|vision_start|>"), to_id("<|vision_end|>")
    at = ids.index(video)
    assert ids.count(video) == 1 and start not in ids and end not in ids, ids[at - 3 : at + 4]
    assert planned.prompt["multi_modal_data"]["video"]["timestamps"] == [[0.25, 1.25]]  # type: ignore[attr-defined]
