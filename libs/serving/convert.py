"""epd.v1 messages <-> engine dataclasses, field for field (the names match by design)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from libs.contract import errors
from libs.contract.epd.v1 import (
    chat_pb2,
    generation_pb2,
    layout_pb2,
    media_pb2,
    prefill_pb2,
    sampling_pb2,
    service_info_pb2,
    tensor_pb2,
)
from libs.contract.reasons import Reason
from libs.model import types as eng
from libs.model.errors import EngineError, ErrorKind, PrefixMissError

MODALITY_TO_ENGINE = {
    media_pb2.MODALITY_IMAGE: eng.Modality.IMAGE,
    media_pb2.MODALITY_VIDEO: eng.Modality.VIDEO,
    media_pb2.MODALITY_AUDIO: eng.Modality.AUDIO,
}
MODALITY_TO_WIRE = {v: k for k, v in MODALITY_TO_ENGINE.items()}
DTYPE_TO_WIRE: dict[str, tensor_pb2.DType.ValueType] = {
    "float32": tensor_pb2.D_TYPE_FLOAT32,
    "float16": tensor_pb2.D_TYPE_FLOAT16,
    "bfloat16": tensor_pb2.D_TYPE_BFLOAT16,
    "int64": tensor_pb2.D_TYPE_INT64,
    "int32": tensor_pb2.D_TYPE_INT32,
    "int8": tensor_pb2.D_TYPE_INT8,
    "uint8": tensor_pb2.D_TYPE_UINT8,
    "bool": tensor_pb2.D_TYPE_BOOL,
}
DTYPE_TO_ENGINE = {v: k for k, v in DTYPE_TO_WIRE.items()}
_FINISH_TO_WIRE = {
    None: generation_pb2.FINISH_REASON_UNSPECIFIED,
    eng.FinishReason.STOP: generation_pb2.FINISH_REASON_STOP,
    eng.FinishReason.LENGTH: generation_pb2.FINISH_REASON_LENGTH,
    eng.FinishReason.STOP_SEQUENCE: generation_pb2.FINISH_REASON_STOP_SEQUENCE,
}
_ERROR_BY_KIND: dict[ErrorKind, type[errors.EpdError]] = {
    ErrorKind.FAILED_PRECONDITION: errors.FailedPrecondition,
    ErrorKind.RESOURCE_EXHAUSTED: errors.ResourceExhausted,
}


@contextmanager
def engine_errors(field_prefix: str = "") -> Iterator[None]:
    """Re-raise engine errors as contract errors (INVALID_ARGUMENT naming the field, or the kind's code)."""
    try:
        yield
    except EngineError as exc:
        if exc.kind is ErrorKind.INVALID_ARGUMENT:
            field = ".".join(p for p in (field_prefix, exc.field) if p) or "request"
            raise errors.InvalidArgument(field, str(exc)) from exc
        # A held item its prefix cache no longer covers: the router encodes it and retries.
        reason = Reason.EMBEDDING_NEEDED if isinstance(exc, PrefixMissError) else None
        raise _ERROR_BY_KIND[exc.kind](str(exc), reason=reason) from exc


def media_input(item: media_pb2.MediaItem, item_index: int, data: bytes) -> eng.MediaInput:
    """A validated wire media item, with its resolved bytes, as engine input."""
    opts = item.processor_options
    return eng.MediaInput(
        modality=MODALITY_TO_ENGINE[item.modality],
        data=data,
        item_index=item_index,
        options=eng.ProcessorOptions(
            min_pixels=opts.min_pixels if opts.HasField("min_pixels") else None,
            max_pixels=opts.max_pixels if opts.HasField("max_pixels") else None,
            video_fps=opts.video_fps if opts.HasField("video_fps") else None,
            video_max_frames=opts.video_max_frames if opts.HasField("video_max_frames") else None,
        ),
        audio_window_start_frame=opts.audio_window_start_frame,
    )


def item_layout_to_wire(layout: eng.ItemLayout) -> layout_pb2.ItemLayout:
    out = layout_pb2.ItemLayout(
        modality=MODALITY_TO_WIRE[layout.modality],
        item_index=layout.item_index,
        mm_hash=layout.mm_hash,
        placeholder_token_count=layout.placeholder_token_count,
        cross_attention_rows=layout.cross_attention_rows,
    )
    if layout.image is not None:
        out.image.CopyFrom(
            layout_pb2.ImageLayout(grid_t=layout.image.grid_t, grid_h=layout.image.grid_h, grid_w=layout.image.grid_w)
        )
    elif layout.video is not None:
        v = layout.video
        out.video.CopyFrom(
            layout_pb2.VideoLayout(
                grid_t=v.grid_t,
                grid_h=v.grid_h,
                grid_w=v.grid_w,
                seconds_per_grid=v.seconds_per_grid,
                grid_timestamps_s=list(v.grid_timestamps_s),
                sampled_frames=v.sampled_frames,
            )
        )
    elif layout.audio is not None:
        a = layout.audio
        out.audio.CopyFrom(
            layout_pb2.AudioLayout(
                feature_length=a.feature_length,
                output_length=a.output_length,
                duration_s=a.duration_s,
                window_start_frame=a.window_start_frame,
                window_frames=a.window_frames,
                clip_frames=a.clip_frames,
            )
        )
    return out


def item_layout_to_engine(layout: layout_pb2.ItemLayout) -> eng.ItemLayout:
    arm = layout.WhichOneof("detail")
    image = video = audio = None
    if arm == "image":
        image = eng.ImageLayout(layout.image.grid_t, layout.image.grid_h, layout.image.grid_w)
    elif arm == "video":
        v = layout.video
        video = eng.VideoLayout(
            v.grid_t, v.grid_h, v.grid_w, v.seconds_per_grid, tuple(v.grid_timestamps_s), v.sampled_frames
        )
    elif arm == "audio":
        a = layout.audio
        audio = eng.AudioLayout(
            a.feature_length, a.output_length, a.duration_s, a.window_start_frame, a.window_frames, a.clip_frames
        )
    return eng.ItemLayout(
        modality=MODALITY_TO_ENGINE[layout.modality],
        item_index=layout.item_index,
        mm_hash=layout.mm_hash,
        placeholder_token_count=layout.placeholder_token_count,
        image=image,
        video=video,
        audio=audio,
        cross_attention_rows=layout.cross_attention_rows,
    )


def embedding_spec_to_wire(spec: eng.EmbeddingSpec) -> service_info_pb2.EmbeddingSpec:
    return service_info_pb2.EmbeddingSpec(
        modality=MODALITY_TO_WIRE[spec.modality],
        width=spec.width,
        dtype=DTYPE_TO_WIRE[spec.dtype],
        extra_tensors=[
            service_info_pb2.ExtraTensorSpec(name=e.name, width=e.width, dtype=DTYPE_TO_WIRE[e.dtype])
            for e in spec.extra_tensors
        ],
    )


def sampling_to_engine(params: sampling_pb2.SamplingParams) -> eng.SamplingParams:
    return eng.SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p if params.HasField("top_p") else 1.0,
        top_k=params.top_k,
        seed=params.seed if params.HasField("seed") else None,
        max_tokens=params.max_tokens,
        stop=tuple(params.stop),
        stop_token_ids=tuple(params.stop_token_ids),
        timestamps=params.timestamps,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty if params.HasField("repetition_penalty") else 1.0,
        min_tokens=params.min_tokens,
        ignore_eos=params.ignore_eos,
        logprobs=params.logprobs if params.HasField("logprobs") else None,
    )


def _logprob_to_wire(entry: eng.TokenLogprob) -> generation_pb2.TokenLogprob:
    return generation_pb2.TokenLogprob(token_id=entry.token_id, logprob=entry.logprob, token=entry.token)


def logprobs_to_wire(entries: Sequence[eng.TokenLogprobs]) -> list[generation_pb2.TokenLogprobs]:
    return [
        generation_pb2.TokenLogprobs(chosen=_logprob_to_wire(e.chosen), top=[_logprob_to_wire(t) for t in e.top])
        for e in entries
    ]


def chunk_to_wire(chunk: eng.TokenChunk) -> generation_pb2.TokenChunk:
    return generation_pb2.TokenChunk(
        token_ids=chunk.token_ids,
        text=chunk.text,
        finish_reason=_FINISH_TO_WIRE[chunk.finish_reason],
        logprobs=logprobs_to_wire(chunk.logprobs or ()),
    )


def kv_layout_to_wire(layout: eng.KvCacheLayout) -> prefill_pb2.KvCacheLayout:
    return prefill_pb2.KvCacheLayout(
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        num_tokens=layout.num_tokens,
        dtype=DTYPE_TO_WIRE[layout.dtype],
        cross_tokens=layout.cross_tokens,
    )


def kv_layout_to_engine(layout: prefill_pb2.KvCacheLayout) -> eng.KvCacheLayout:
    return eng.KvCacheLayout(
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        num_tokens=layout.num_tokens,
        dtype=DTYPE_TO_ENGINE[layout.dtype],
        cross_tokens=layout.cross_tokens,
    )


def decode_state_to_wire(state: eng.DecodeState) -> prefill_pb2.DecodeState:
    return prefill_pb2.DecodeState(
        next_input_token_id=state.next_input_token_id,
        rope_delta=state.rope_delta,
        generated_tokens=state.generated_tokens,
        generated_text=state.generated_text,
        prompt_tokens=state.prompt_tokens,
        prompt_token_ids=state.prompt_token_ids,
        cached_prompt_tokens=state.cached_prompt_tokens,
    )


def decode_state_to_engine(state: prefill_pb2.DecodeState) -> eng.DecodeState:
    return eng.DecodeState(
        next_input_token_id=state.next_input_token_id,
        rope_delta=state.rope_delta,
        generated_tokens=state.generated_tokens,
        generated_text=state.generated_text,
        prompt_tokens=state.prompt_tokens,
        prompt_token_ids=tuple(state.prompt_token_ids),
        cached_prompt_tokens=state.cached_prompt_tokens,
    )


_ROLE_TO_ENGINE = {
    chat_pb2.CHAT_ROLE_SYSTEM: eng.ChatRole.SYSTEM,
    chat_pb2.CHAT_ROLE_USER: eng.ChatRole.USER,
    chat_pb2.CHAT_ROLE_ASSISTANT: eng.ChatRole.ASSISTANT,
    chat_pb2.CHAT_ROLE_RAW: eng.ChatRole.RAW,
}


def media_parts(messages: Sequence[chat_pb2.ChatMessage]) -> list[chat_pb2.ContentPart]:
    """The non-text parts of a conversation, in prompt order (their position is the item index)."""
    return [part for message in messages for part in message.parts if part.WhichOneof("kind") != "text"]


def messages_to_engine(
    messages: Sequence[chat_pb2.ChatMessage], items: Sequence[eng.EncodedItem]
) -> list[eng.ChatMessage]:
    """The conversation for the engine; the i-th media part becomes `items[i]`."""
    out = []
    index = 0
    for message in messages:
        parts: list[eng.TextPart | eng.EncodedPart] = []
        for part in message.parts:
            if part.WhichOneof("kind") == "text":
                parts.append(eng.TextPart(part.text))
            else:
                parts.append(eng.EncodedPart(items[index]))
                index += 1
        out.append(eng.ChatMessage(_ROLE_TO_ENGINE[message.role], tuple(parts)))
    return out
