"""Semantic validation of every epd.v1 request, shared by all services.

Each `validate_*` function checks one request type against the contract's rules and the server's
`Limits`, and raises `InvalidArgument` naming the first offending field by its path
(`messages[0].parts[2].media.modality`). Servers call the validator of the request type they serve
before doing any work; nothing here touches the network or the model.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from libs.contract.bounds import checked
from libs.contract.epd.v1 import (
    chat_pb2,
    decode_pb2,
    encoder_pb2,
    generate_pb2,
    layout_pb2,
    lease_pb2,
    media_pb2,
    prefill_decode_pb2,
    prefill_pb2,
    sampling_pb2,
    service_info_pb2,
    tensor_pb2,
)
from libs.contract.errors import InvalidArgument

# Bytes per element of each dtype.
DTYPE_SIZES: dict[int, int] = {
    tensor_pb2.D_TYPE_FLOAT32: 4,
    tensor_pb2.D_TYPE_FLOAT16: 2,
    tensor_pb2.D_TYPE_BFLOAT16: 2,
    tensor_pb2.D_TYPE_INT64: 8,
    tensor_pb2.D_TYPE_INT32: 4,
    tensor_pb2.D_TYPE_INT8: 1,
    tensor_pb2.D_TYPE_UINT8: 1,
    tensor_pb2.D_TYPE_BOOL: 1,
}

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]+$")
_KV_TENSOR_NAME = re.compile(r"^layers\.(\d+)\.(key|value|cross_key|cross_value)$")


@dataclass(frozen=True)
class Limits:
    """Upper bounds a server enforces on requests. Defaults suit the reference deployment."""

    max_request_id_chars: int = 128
    max_messages: int = 256
    max_parts_per_message: int = 64
    max_text_bytes: int = 1 << 20
    max_media_items: int = 16
    max_inline_media_bytes: int = 64 << 20
    max_uri_chars: int = 4096
    max_pixels: int = 16 << 20
    max_video_frames: int = 768
    max_tokens: int = 4096
    max_stop_sequences: int = 8
    max_stop_sequence_chars: int = 256
    max_stop_token_ids: int = 64
    max_tensors_per_handle: int = 1024
    max_tensor_dims: int = 8
    max_tensor_bytes: int = 8 << 30
    max_regions_per_tensor: int = 64
    max_placeholder_tokens: int = 1 << 20
    max_lease_ids: int = 1024
    max_id_chars: int = 256  # ids and hosts inside a paged KV handoff
    max_kv_block_groups: int = 64
    max_kv_blocks: int = 1 << 20  # per group
    max_prompt_tokens: int = 1 << 20  # of an engine prompt (before placeholder expansion)
    max_logprobs: int = 20  # alternatives per generated token (vLLM's default max_logprobs)


DEFAULT_LIMITS = Limits()


def _fail(path: str, problem: str) -> InvalidArgument:
    return InvalidArgument(path, problem)


def _require_enum(value: int, path: str, enum_name: str, known: Sequence[int]) -> None:
    if value == 0:
        raise _fail(path, f"must be set (not {enum_name}_UNSPECIFIED)")
    if value not in known:
        raise _fail(path, f"unknown {enum_name} value {value}")


def _check_count(items: Sequence[object], path: str, minimum: int, maximum: int) -> None:
    if len(items) < minimum:
        raise _fail(path, f"needs at least {minimum} entr{'y' if minimum == 1 else 'ies'}")
    if len(items) > maximum:
        raise _fail(path, f"has {len(items)} entries; the limit is {maximum}")


def _check_request_id(request_id: str, path: str, limits: Limits, required: bool = True) -> None:
    if not request_id:
        if required:
            raise _fail(path, "must not be empty")
        return
    if len(request_id) > limits.max_request_id_chars:
        raise _fail(path, f"is {len(request_id)} characters; the limit is {limits.max_request_id_chars}")
    if not _REQUEST_ID.match(request_id):
        raise _fail(path, "may contain only letters, digits and . _ : -")


# --- media -----------------------------------------------------------------------------------


def validate_processor_options(opts: media_pb2.ProcessorOptions, path: str, limits: Limits) -> None:
    """Check preprocessing overrides: positive and within limits, min <= max."""
    for name in ("min_pixels", "max_pixels"):
        if opts.HasField(name):
            value = getattr(opts, name)
            if value <= 0 or value > limits.max_pixels:
                raise _fail(f"{path}.{name}", f"must be in [1, {limits.max_pixels}] pixels, got {value}")
    if opts.HasField("min_pixels") and opts.HasField("max_pixels") and opts.min_pixels > opts.max_pixels:
        raise _fail(f"{path}.min_pixels", f"{opts.min_pixels} exceeds max_pixels {opts.max_pixels}")
    if opts.HasField("video_fps") and not (0 < opts.video_fps <= 120 and math.isfinite(opts.video_fps)):
        raise _fail(f"{path}.video_fps", f"must be in (0, 120] frames per second, got {opts.video_fps}")
    if opts.HasField("video_max_frames") and not (0 < opts.video_max_frames <= limits.max_video_frames):
        raise _fail(
            f"{path}.video_max_frames",
            f"must be in [1, {limits.max_video_frames}] frames, got {opts.video_max_frames}",
        )
    if opts.audio_window_start_frame < 0:  # contract 1.4
        raise _fail(f"{path}.audio_window_start_frame", f"must be >= 0 frames, got {opts.audio_window_start_frame}")


def validate_media_item(item: media_pb2.MediaItem, path: str, limits: Limits) -> None:
    """Check a client media item: modality set, exactly one non-empty bounded source."""
    _require_enum(item.modality, f"{path}.modality", "MODALITY", media_pb2.Modality.values())
    source = item.WhichOneof("source")
    if source is None:
        raise _fail(f"{path}.source", "one of data or uri is required")
    if source == "data":
        size = len(item.data)  # each read of a bytes field copies it out of the message: read once
        if not size:
            raise _fail(f"{path}.data", "must not be empty")
        if size > limits.max_inline_media_bytes:
            raise _fail(f"{path}.data", f"is {size} bytes; the limit is {limits.max_inline_media_bytes}")
    else:
        if not item.uri:
            raise _fail(f"{path}.uri", "must not be empty")
        if len(item.uri) > limits.max_uri_chars:
            raise _fail(f"{path}.uri", f"is {len(item.uri)} characters; the limit is {limits.max_uri_chars}")
    if item.mime_type and "/" not in item.mime_type:
        raise _fail(f"{path}.mime_type", f"{item.mime_type!r} is not a MIME type")
    validate_processor_options(item.processor_options, f"{path}.processor_options", limits)


# --- tensors ---------------------------------------------------------------------------------


def validate_tensor_spec(spec: tensor_pb2.TensorSpec, path: str, limits: Limits) -> None:
    """Check dims are non-negative and `nbytes` equals product(shape) * element size."""
    _require_enum(spec.dtype, f"{path}.dtype", "D_TYPE", tensor_pb2.DType.values())
    _require_enum(spec.layout, f"{path}.layout", "TENSOR_LAYOUT", tensor_pb2.TensorLayout.values())
    if len(spec.shape) > limits.max_tensor_dims:
        raise _fail(f"{path}.shape", f"has {len(spec.shape)} dimensions; the limit is {limits.max_tensor_dims}")
    for i, dim in enumerate(spec.shape):
        if dim < 0:
            raise _fail(f"{path}.shape[{i}]", f"must be >= 0, got {dim}")
    if spec.nbytes < 0 or spec.nbytes > limits.max_tensor_bytes:
        raise _fail(f"{path}.nbytes", f"must be in [0, {limits.max_tensor_bytes}] bytes, got {spec.nbytes}")
    expected = math.prod(spec.shape) * DTYPE_SIZES[spec.dtype]
    if spec.nbytes != expected:
        raise _fail(
            f"{path}.nbytes",
            f"{spec.nbytes} bytes does not match shape {list(spec.shape)} of "
            f"{tensor_pb2.DType.Name(spec.dtype)} ({expected} bytes)",
        )


def _validate_descriptor(desc: tensor_pb2.TensorDescriptor, transport: int, path: str, limits: Limits) -> None:
    if not desc.name:
        raise _fail(f"{path}.name", "must not be empty")
    if not desc.HasField("spec"):
        raise _fail(f"{path}.spec", "is required")
    validate_tensor_spec(desc.spec, f"{path}.spec", limits)
    if desc.checksum.algorithm not in tensor_pb2.ChecksumAlgorithm.values():
        raise _fail(f"{path}.checksum.algorithm", f"unknown ChecksumAlgorithm value {desc.checksum.algorithm}")
    if transport == tensor_pb2.TRANSPORT_KIND_INLINE:
        if desc.regions:
            raise _fail(f"{path}.regions", "must be empty for TRANSPORT_KIND_INLINE")
        if len(desc.inline_data) != desc.spec.nbytes:
            raise _fail(f"{path}.inline_data", f"is {len(desc.inline_data)} bytes; spec.nbytes is {desc.spec.nbytes}")
        return
    if desc.inline_data:
        raise _fail(f"{path}.inline_data", "must be empty for TRANSPORT_KIND_NIXL")
    _check_count(desc.regions, f"{path}.regions", 1 if desc.spec.nbytes else 0, limits.max_regions_per_tensor)
    total = 0
    for i, region in enumerate(desc.regions):
        rpath = f"{path}.regions[{i}]"
        _require_enum(region.memory_kind, f"{rpath}.memory_kind", "MEMORY_KIND", tensor_pb2.MemoryKind.values())
        if region.length == 0:
            raise _fail(f"{rpath}.length", "must be > 0")
        if region.address == 0:
            raise _fail(f"{rpath}.address", "must not be 0")
        if region.address + region.length > 1 << 64:
            raise _fail(f"{rpath}.length", "region runs past the end of the address space")
        total += region.length
    if total != desc.spec.nbytes:
        raise _fail(f"{path}.regions", f"lengths sum to {total} bytes; spec.nbytes is {desc.spec.nbytes}")


def validate_tensor_handle(handle: tensor_pb2.TensorHandle, path: str, limits: Limits) -> None:
    """Check a handle is self-consistent: transport, lease, agent (NIXL), unique tensor names,
    and descriptors whose specs match their bytes."""
    _require_enum(handle.transport, f"{path}.transport", "TRANSPORT_KIND", tensor_pb2.TransportKind.values())
    if not handle.lease_id:
        raise _fail(f"{path}.lease_id", "must not be empty")
    if handle.transport == tensor_pb2.TRANSPORT_KIND_NIXL:
        if not handle.agent.agent_name:
            raise _fail(f"{path}.agent.agent_name", "must not be empty for TRANSPORT_KIND_NIXL")
        if not handle.agent.producer_address:
            raise _fail(f"{path}.agent.producer_address", "must not be empty for TRANSPORT_KIND_NIXL")
    _check_count(handle.tensors, f"{path}.tensors", 1, limits.max_tensors_per_handle)
    seen: set[str] = set()
    for i, desc in enumerate(handle.tensors):
        _validate_descriptor(desc, handle.transport, f"{path}.tensors[{i}]", limits)
        if desc.name in seen:
            raise _fail(f"{path}.tensors[{i}].name", f"duplicate tensor name {desc.name!r}")
        seen.add(desc.name)


# --- layout ----------------------------------------------------------------------------------

_LAYOUT_ARM = {
    media_pb2.MODALITY_IMAGE: "image",
    media_pb2.MODALITY_VIDEO: "video",
    media_pb2.MODALITY_AUDIO: "audio",
}


def _check_grid(layout: layout_pb2.ImageLayout | layout_pb2.VideoLayout, path: str) -> None:
    for name in ("grid_t", "grid_h", "grid_w"):
        if getattr(layout, name) <= 0:
            raise _fail(f"{path}.{name}", f"must be > 0 patches, got {getattr(layout, name)}")


def validate_item_layout(layout: layout_pb2.ItemLayout, path: str, limits: Limits) -> None:
    """Check modality, hash, token count, and that the per-modality arm matches the modality."""
    _require_enum(layout.modality, f"{path}.modality", "MODALITY", media_pb2.Modality.values())
    if not layout.mm_hash:
        raise _fail(f"{path}.mm_hash", "must not be empty")
    _check_rows(layout, path, limits)
    arm = layout.WhichOneof("detail")
    expected = _LAYOUT_ARM[layout.modality]
    if arm != expected:
        raise _fail(f"{path}.{expected}", f"is required for {media_pb2.Modality.Name(layout.modality)}")
    if arm == "image":
        _check_grid(layout.image, f"{path}.image")
    elif arm == "video":
        video = layout.video
        _check_grid(video, f"{path}.video")
        if video.seconds_per_grid < 0 or not math.isfinite(video.seconds_per_grid):
            raise _fail(f"{path}.video.seconds_per_grid", f"must be >= 0 seconds, got {video.seconds_per_grid}")
        if video.grid_timestamps_s and len(video.grid_timestamps_s) != video.grid_t:
            raise _fail(
                f"{path}.video.grid_timestamps_s",
                f"has {len(video.grid_timestamps_s)} entries; grid_t is {video.grid_t}",
            )
        if any(b < a for a, b in zip(video.grid_timestamps_s, video.grid_timestamps_s[1:], strict=False)):
            raise _fail(f"{path}.video.grid_timestamps_s", "must be non-decreasing")
        if video.sampled_frames < 0:
            raise _fail(f"{path}.video.sampled_frames", f"must be >= 0 frames, got {video.sampled_frames}")
    else:
        audio = layout.audio
        if audio.feature_length <= 0:
            raise _fail(f"{path}.audio.feature_length", f"must be > 0 frames, got {audio.feature_length}")
        if audio.output_length != _rows(layout):
            raise _fail(
                f"{path}.audio.output_length",
                f"{audio.output_length} tokens does not match placeholder_token_count {layout.placeholder_token_count}"
                f" / cross_attention_rows {layout.cross_attention_rows}",
            )
        _check_audio_window(audio, f"{path}.audio")


def _rows(layout: layout_pb2.ItemLayout) -> int:
    """Rows of the item's "embeddings" tensor: encoder states (encoder-decoder) or prompt embeddings."""
    return layout.cross_attention_rows or layout.placeholder_token_count


def _check_rows(layout: layout_pb2.ItemLayout, path: str, limits: Limits) -> None:
    """An item takes prompt positions, or (contract 1.4, encoder-decoder models) is cross-attended
    to; never both."""
    if layout.cross_attention_rows:
        if not 0 < layout.cross_attention_rows <= limits.max_placeholder_tokens:
            raise _fail(
                f"{path}.cross_attention_rows",
                f"must be in [1, {limits.max_placeholder_tokens}] rows, got {layout.cross_attention_rows}",
            )
        if layout.placeholder_token_count:
            raise _fail(f"{path}.placeholder_token_count", "must be 0 with cross_attention_rows")
        return
    if not 0 < layout.placeholder_token_count <= limits.max_placeholder_tokens:
        raise _fail(
            f"{path}.placeholder_token_count",
            f"must be in [1, {limits.max_placeholder_tokens}] tokens, got {layout.placeholder_token_count}",
        )


def _check_audio_window(audio: layout_pb2.AudioLayout, path: str) -> None:
    """Contract 1.4: a window lies inside its clip (all 0: the tower took the whole clip)."""
    for name in ("window_start_frame", "window_frames", "clip_frames"):
        if getattr(audio, name) < 0:
            raise _fail(f"{path}.{name}", f"must be >= 0 frames, got {getattr(audio, name)}")
    if audio.clip_frames and audio.window_start_frame + audio.window_frames > audio.clip_frames:
        raise _fail(
            f"{path}.window_frames",
            f"window [{audio.window_start_frame}, +{audio.window_frames}) ends past clip_frames {audio.clip_frames}",
        )


def validate_encoded_media(item: layout_pb2.EncodedMedia, path: str, limits: Limits) -> None:
    """Check layout and handle, and that the embeddings tensor has one row per placeholder."""
    if not item.HasField("layout"):
        raise _fail(f"{path}.layout", "is required")
    validate_item_layout(item.layout, f"{path}.layout", limits)
    if item.prefix_held:  # contract 1.9: the member's prefix cache holds it; nothing to read
        if item.HasField("embeddings"):
            raise _fail(f"{path}.embeddings", "must be unset with prefix_held")
        if item.layout.cross_attention_rows:
            raise _fail(f"{path}.prefix_held", "an encoder-decoder item is never held in a prefix cache")
        return
    if not item.HasField("embeddings"):
        raise _fail(f"{path}.embeddings", "is required")
    validate_tensor_handle(item.embeddings, f"{path}.embeddings", limits)
    rows_field = "cross_attention_rows" if item.layout.cross_attention_rows else "placeholder_token_count"
    for i, desc in enumerate(item.embeddings.tensors):
        shape = list(desc.spec.shape)
        if desc.name == "embeddings" and (len(shape) != 2 or shape[0] != _rows(item.layout)):
            raise _fail(
                f"{path}.embeddings.tensors[{i}].spec.shape",
                f"{shape} does not match [{rows_field}, width] with {rows_field}={_rows(item.layout)}",
            )
    if "embeddings" not in {d.name for d in item.embeddings.tensors}:
        raise _fail(f"{path}.embeddings.tensors", "needs a tensor named 'embeddings'")


# --- chat and sampling -----------------------------------------------------------------------


def validate_messages(messages: Sequence[chat_pb2.ChatMessage], path: str, limits: Limits, media_kind: str) -> None:
    """Check a conversation. `media_kind` is the part kind media must take here: "media" at the
    router (client media) or "encoded" at prefill (metadata-only references)."""
    _check_count(messages, path, 1, limits.max_messages)
    forbidden = "encoded" if media_kind == "media" else "media"
    if raw_prompt(messages):
        if len(messages) != 1:
            raise _fail(path, "a raw prompt (CHAT_ROLE_RAW) is the only message of its request")
        if any(part.WhichOneof("kind") != "text" for part in messages[0].parts):
            raise _fail(f"{path}[0].parts", "a raw prompt (CHAT_ROLE_RAW) holds text parts only")
    media_count = 0
    for m, message in enumerate(messages):
        mpath = f"{path}[{m}]"
        _require_enum(message.role, f"{mpath}.role", "CHAT_ROLE", chat_pb2.ChatRole.values())
        _check_count(message.parts, f"{mpath}.parts", 1, limits.max_parts_per_message)
        for p, part in enumerate(message.parts):
            ppath = f"{mpath}.parts[{p}]"
            kind = part.WhichOneof("kind")
            if kind is None:
                raise _fail(f"{ppath}.kind", "one of text, media or encoded is required")
            if kind == forbidden:
                raise _fail(f"{ppath}.{kind}", f"not accepted here; media must be sent as `{media_kind}`")
            if kind == "text":
                if len(part.text.encode()) > limits.max_text_bytes:
                    raise _fail(f"{ppath}.text", f"exceeds {limits.max_text_bytes} bytes")
                continue
            media_count += 1
            if media_count > limits.max_media_items:
                raise _fail(ppath, f"request has more than {limits.max_media_items} media items")
            if kind == "media":
                validate_media_item(part.media, f"{ppath}.media", limits)
            else:
                validate_encoded_media(part.encoded, f"{ppath}.encoded", limits)
                if part.encoded.layout.item_index != media_count - 1:
                    raise _fail(
                        f"{ppath}.encoded.layout.item_index",
                        f"is {part.encoded.layout.item_index}; items must appear in order (expected {media_count - 1})",
                    )


def validate_sampling(sampling: sampling_pb2.SamplingParams, path: str, limits: Limits) -> None:
    """Check sampling parameters are in range and stop conditions are bounded."""
    if not (math.isfinite(sampling.temperature) and 0 <= sampling.temperature <= 100):
        raise _fail(f"{path}.temperature", f"must be in [0, 100], got {sampling.temperature}")
    if sampling.HasField("top_p") and not 0 < sampling.top_p <= 1:
        raise _fail(f"{path}.top_p", f"must be in (0, 1], got {sampling.top_p}")
    if sampling.top_k < 0:
        raise _fail(f"{path}.top_k", f"must be >= 0, got {sampling.top_k}")
    if not 0 <= sampling.max_tokens <= limits.max_tokens:
        raise _fail(
            f"{path}.max_tokens",
            f"must be in [1, {limits.max_tokens}] tokens, or 0 for the server's default; got {sampling.max_tokens}",
        )
    _check_count(sampling.stop, f"{path}.stop", 0, limits.max_stop_sequences)
    for i, stop in enumerate(sampling.stop):
        if not stop:
            raise _fail(f"{path}.stop[{i}]", "must not be empty")
        if len(stop) > limits.max_stop_sequence_chars:
            raise _fail(f"{path}.stop[{i}]", f"exceeds {limits.max_stop_sequence_chars} characters")
    _check_count(sampling.stop_token_ids, f"{path}.stop_token_ids", 0, limits.max_stop_token_ids)
    for i, token in enumerate(sampling.stop_token_ids):
        if token < 0:
            raise _fail(f"{path}.stop_token_ids[{i}]", f"must be >= 0, got {token}")
    # Since 1.6, with vLLM's ranges (vllm.SamplingParams._verify_args).
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(sampling, name)
        if not (math.isfinite(value) and -2 <= value <= 2):
            raise _fail(f"{path}.{name}", f"must be in [-2, 2], got {value}")
    if sampling.HasField("repetition_penalty") and not (
        math.isfinite(sampling.repetition_penalty) and 0 < sampling.repetition_penalty <= MAX_REPETITION_PENALTY
    ):
        raise _fail(
            f"{path}.repetition_penalty",
            f"must be in (0, {MAX_REPETITION_PENALTY:g}], got {sampling.repetition_penalty}",
        )
    ceiling = sampling.max_tokens or limits.max_tokens
    if not 0 <= sampling.min_tokens <= ceiling:
        raise _fail(f"{path}.min_tokens", f"must be in [0, {ceiling}] (at most max_tokens), got {sampling.min_tokens}")
    if sampling.HasField("logprobs") and not 0 <= sampling.logprobs <= limits.max_logprobs:
        raise _fail(f"{path}.logprobs", f"must be in [0, {limits.max_logprobs}], got {sampling.logprobs}")


def sampling_params(
    values: Mapping[str, Any], path: str = "sampling", limits: Limits = DEFAULT_LIMITS
) -> sampling_pb2.SamplingParams:
    """`SamplingParams` from plain values (an HTTP body's), refused as the router refuses it: each
    value within its field's width (`bounds.checked`: what the wire guarantees a gRPC caller's
    message), then `validate_sampling`, the check the router applies to every `Generate`."""
    params = checked(sampling_pb2.SamplingParams, path, **values)
    validate_sampling(params, path, limits)
    return params


# Beyond this a repetition penalty only zeroes the seen tokens' probabilities; bounded so a typo
# (100 for 1.00) is refused rather than served.
MAX_REPETITION_PENALTY = 10.0


def uses_since_1_6(sampling: sampling_pb2.SamplingParams) -> str | None:
    """The first contract-1.6 sampling field `sampling` sets, or None: a peer speaking an older
    minor would drop it silently (unknown fields are ignored), so the router refuses to send it."""
    for name in SAMPLING_FIELDS_SINCE_1_6:
        # Optional fields count once set (even to the default); the others when not the default.
        present = sampling.HasField(name) if name in ("repetition_penalty", "logprobs") else getattr(sampling, name)  # type: ignore[arg-type]
        if present:
            return name
    return None


# Contract 1.4: the encoder, prefill and decode services of an encoder-decoder speech model
# (Whisper) advertise this: they take window starts, cross-attention items and caches, and the
# timestamps flag; a router advertises it for a stack that serves such a model.
SPEECH_TRANSCRIPTION = "speech.transcription"

# Contract 1.6: prefill and PD services that take a raw prompt (CHAT_ROLE_RAW) advertise this.
RAW_PROMPT_CAPABILITY = "prompt.raw"


def raw_prompt(messages: Sequence[chat_pb2.ChatMessage]) -> bool:
    return any(message.role == chat_pb2.CHAT_ROLE_RAW for message in messages)


# Contract 1.9: prefill and PD services whose prefix cache can stand in for an item's embeddings
# (`EncodedMedia.prefix_held`) advertise this; the router sends held items only to them.
HELD_ITEMS_CAPABILITY = "prefix.held_items"

# Contract 1.6: advertised by prefill, decode and PD services that implement these fields; the
# router sends a request setting one only to such peers.
SAMPLING_CAPABILITY = "sampling.openai"
SAMPLING_FIELDS_SINCE_1_6 = (
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "logprobs",
)


MAX_PRIORITY = 100


def _check_priority(priority: int) -> None:
    if not -MAX_PRIORITY <= priority <= MAX_PRIORITY:
        raise _fail("priority", f"must be in [-{MAX_PRIORITY}, {MAX_PRIORITY}], got {priority}")


def _validate_transports(transports: Sequence[int], path: str) -> None:
    _check_count(transports, path, 1, len(tensor_pb2.TransportKind.values()))
    for i, transport in enumerate(transports):
        _require_enum(transport, f"{path}[{i}]", "TRANSPORT_KIND", tensor_pb2.TransportKind.values())


def validate_kv_cache(kv: prefill_pb2.KvCache, path: str, limits: Limits) -> None:
    """Check a KV cache: positive layout, one key and one value tensor per layer, each
    [num_kv_heads, num_tokens, head_dim] of the layout's dtype."""
    layout = kv.layout
    for name in ("num_layers", "num_kv_heads", "head_dim", "num_tokens"):
        if getattr(layout, name) <= 0:
            raise _fail(f"{path}.layout.{name}", f"must be > 0, got {getattr(layout, name)}")
    _require_enum(layout.dtype, f"{path}.layout.dtype", "D_TYPE", tensor_pb2.DType.values())
    if kv.HasField("paged"):  # contract 1.3: the KV stays in the prefill engine's blocks
        if kv.HasField("handle"):
            raise _fail(f"{path}.handle", "must not be set with paged (exactly one of handle and paged)")
        validate_paged_kv_blocks(kv.paged, f"{path}.paged", limits)
        return
    if not kv.HasField("handle"):
        raise _fail(f"{path}.handle", "is required (or paged)")
    validate_tensor_handle(kv.handle, f"{path}.handle", limits)
    if layout.cross_tokens < 0:
        raise _fail(f"{path}.layout.cross_tokens", f"must be >= 0 tokens, got {layout.cross_tokens}")
    # Contract 1.4: encoder-decoder caches carry a cross-attention key and value per layer too.
    per_layer = 4 if layout.cross_tokens else 2
    if len(kv.handle.tensors) != per_layer * layout.num_layers:
        raise _fail(
            f"{path}.handle.tensors",
            f"has {len(kv.handle.tensors)} tensors; {per_layer} * num_layers is {per_layer * layout.num_layers}",
        )
    for i, desc in enumerate(kv.handle.tensors):
        tpath = f"{path}.handle.tensors[{i}]"
        match = _KV_TENSOR_NAME.match(desc.name)
        cross = match is not None and match.group(2).startswith("cross_")
        if match is None or int(match.group(1)) >= layout.num_layers or (cross and not layout.cross_tokens):
            raise _fail(f"{tpath}.name", f"{desc.name!r} is not layers.<i>.key|value with i < num_layers")
        tokens = layout.cross_tokens if cross else layout.num_tokens
        want_shape = [layout.num_kv_heads, tokens, layout.head_dim]
        if list(desc.spec.shape) != want_shape:
            raise _fail(f"{tpath}.spec.shape", f"{list(desc.spec.shape)} != {want_shape}")
        if desc.spec.dtype != layout.dtype:
            raise _fail(f"{tpath}.spec.dtype", "differs from layout.dtype")


def validate_paged_kv_blocks(paged: prefill_pb2.PagedKvBlocks, path: str, limits: Limits) -> None:
    """Check a paged KV handoff (contract 1.3): who holds the blocks, how to reach its engine, and
    bounded block lists."""
    for name in ("producer_address", "lease_id", "engine_id", "engine_request_id", "side_channel_host"):
        value = getattr(paged, name)
        if not value:
            raise _fail(f"{path}.{name}", "is required")
        if len(value) > limits.max_id_chars:
            raise _fail(f"{path}.{name}", f"is longer than {limits.max_id_chars} characters")
    if not paged.HasField("lease_expire_time"):
        raise _fail(f"{path}.lease_expire_time", "is required")
    if not 0 < paged.side_channel_port <= 65535:
        raise _fail(f"{path}.side_channel_port", f"must be in [1, 65535], got {paged.side_channel_port}")
    _check_count(paged.groups, f"{path}.groups", 1, limits.max_kv_block_groups)
    for i, group in enumerate(paged.groups):
        _check_count(group.block_ids, f"{path}.groups[{i}].block_ids", 1, limits.max_kv_blocks)
        if min(group.block_ids) < 0:
            raise _fail(f"{path}.groups[{i}].block_ids", "must be >= 0")
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "decode_context_parallel_size"):
        if getattr(paged, name) < 1:
            raise _fail(f"{path}.{name}", f"must be >= 1, got {getattr(paged, name)}")
    _require_enum(paged.transfer_mode, f"{path}.transfer_mode", "KV_TRANSFER_MODE", prefill_pb2.KvTransferMode.values())


def validate_engine_prompt(prompt: prefill_pb2.EnginePrompt, path: str, limits: Limits) -> None:
    """Check the prompt a decode engine rebuilds the sequence from (contract 1.3)."""
    _check_count(prompt.token_ids, f"{path}.token_ids", 1, limits.max_prompt_tokens)
    if min(prompt.token_ids) < 0:
        raise _fail(f"{path}.token_ids", "must be >= 0")
    _check_count(prompt.items, f"{path}.items", 0, limits.max_media_items)
    for i, item in enumerate(prompt.items):
        validate_item_layout(item, f"{path}.items[{i}]", limits)


def validate_decode_state(state: prefill_pb2.DecodeState, path: str, limits: Limits) -> None:
    """Check decode's per-sequence state."""
    if state.next_input_token_id < 0:
        raise _fail(f"{path}.next_input_token_id", f"must be >= 0, got {state.next_input_token_id}")
    if state.generated_tokens < 1:
        raise _fail(f"{path}.generated_tokens", f"must be >= 1 (prefill emits one), got {state.generated_tokens}")
    if state.prompt_tokens < 1:
        raise _fail(f"{path}.prompt_tokens", f"must be >= 1, got {state.prompt_tokens}")
    if state.HasField("engine_prompt"):
        validate_engine_prompt(state.engine_prompt, f"{path}.engine_prompt", limits)
    if state.prompt_token_ids and len(state.prompt_token_ids) != state.prompt_tokens:
        raise _fail(
            f"{path}.prompt_token_ids",
            f"has {len(state.prompt_token_ids)} ids; prompt_tokens is {state.prompt_tokens}",
        )
    for i, token in enumerate(state.prompt_token_ids):
        if token < 0:
            raise _fail(f"{path}.prompt_token_ids[{i}]", f"must be >= 0, got {token}")


# --- requests --------------------------------------------------------------------------------


MAX_CACHE_SALT_BYTES = 256


def _check_cache_salt(salt: str) -> None:
    if len(salt.encode()) > MAX_CACHE_SALT_BYTES:
        raise _fail("cache_salt", f"is {len(salt.encode())} bytes; at most {MAX_CACHE_SALT_BYTES}")


def validate_generate_request(req: generate_pb2.GenerateRequest, limits: Limits = DEFAULT_LIMITS) -> None:
    """Router / colocated `Generate`: client media inline or by URI; request id optional."""
    _check_request_id(req.request_id, "request_id", limits, required=False)
    _check_priority(req.priority)
    _check_cache_salt(req.cache_salt)
    validate_messages(req.messages, "messages", limits, media_kind="media")
    validate_sampling(req.sampling, "sampling", limits)


def validate_encode_request(req: encoder_pb2.EncodeRequest, limits: Limits = DEFAULT_LIMITS) -> None:
    """Encoder `Encode`: bounded items with distinct indexes; accepted transports."""
    _check_request_id(req.request_id, "request_id", limits)
    _check_priority(req.priority)
    _check_count(req.items, "items", 1, limits.max_media_items)
    seen: set[int] = set()
    for i, item in enumerate(req.items):
        if item.item_index in seen:
            raise _fail(f"items[{i}].item_index", f"duplicate item_index {item.item_index}")
        seen.add(item.item_index)
        if not item.HasField("media"):
            raise _fail(f"items[{i}].media", "is required")
        validate_media_item(item.media, f"items[{i}].media", limits)
    _validate_transports(req.accepted_transports, "accepted_transports")
    if req.cache_policy not in encoder_pb2.CachePolicy.values():  # UNSPECIFIED (the default) is fine
        raise _fail("cache_policy", f"unknown CACHE_POLICY value {req.cache_policy}")


def validate_prefill_request(req: prefill_pb2.PrefillRequest, limits: Limits = DEFAULT_LIMITS) -> None:
    """Prefill: metadata-only conversation (media only as `encoded`), KV transports."""
    _check_request_id(req.request_id, "request_id", limits)
    _check_priority(req.priority)
    _check_cache_salt(req.cache_salt)
    validate_messages(req.messages, "messages", limits, media_kind="encoded")
    validate_sampling(req.sampling, "sampling", limits)
    _validate_transports(req.accepted_kv_transports, "accepted_kv_transports")


def validate_prefill_decode_request(
    req: prefill_decode_pb2.PrefillDecodeRequest, limits: Limits = DEFAULT_LIMITS
) -> None:
    """PD (E+PD layout): metadata-only conversation."""
    _check_request_id(req.request_id, "request_id", limits)
    _check_priority(req.priority)
    _check_cache_salt(req.cache_salt)
    validate_messages(req.messages, "messages", limits, media_kind="encoded")
    validate_sampling(req.sampling, "sampling", limits)


def validate_decode_request(req: decode_pb2.DecodeRequest, limits: Limits = DEFAULT_LIMITS) -> None:
    """Decode: a consistent KV cache and decode state."""
    _check_request_id(req.request_id, "request_id", limits)
    _check_priority(req.priority)
    if not req.HasField("kv_cache"):
        raise _fail("kv_cache", "is required")
    validate_kv_cache(req.kv_cache, "kv_cache", limits)
    if not req.HasField("decode_state"):
        raise _fail("decode_state", "is required")
    validate_decode_state(req.decode_state, "decode_state", limits)
    if req.kv_cache.HasField("paged") and not req.decode_state.HasField("engine_prompt"):
        raise _fail("decode_state.engine_prompt", "is required with kv_cache.paged")
    if req.decode_state.prompt_tokens + req.decode_state.generated_tokens - 1 != req.kv_cache.layout.num_tokens:
        raise _fail(
            "kv_cache.layout.num_tokens",
            f"is {req.kv_cache.layout.num_tokens}; decode_state implies "
            f"{req.decode_state.prompt_tokens + req.decode_state.generated_tokens - 1}",
        )
    validate_sampling(req.sampling, "sampling", limits)


def validate_release_leases_request(req: lease_pb2.ReleaseLeasesRequest, limits: Limits = DEFAULT_LIMITS) -> None:
    """`ReleaseLeases`: non-empty bounded lease ids and a reason."""
    _check_count(req.lease_ids, "lease_ids", 1, limits.max_lease_ids)
    for i, lease_id in enumerate(req.lease_ids):
        if not lease_id:
            raise _fail(f"lease_ids[{i}]", "must not be empty")
    _require_enum(req.reason, "reason", "RELEASE_REASON", lease_pb2.ReleaseReason.values())


def validate_get_service_info_request(
    req: service_info_pb2.GetServiceInfoRequest, limits: Limits = DEFAULT_LIMITS
) -> None:
    """`GetServiceInfo`: the caller's version is optional; when given, its major must be > 0."""
    if req.HasField("caller_contract_version") and req.caller_contract_version.major == 0:
        raise _fail("caller_contract_version.major", "must be >= 1 when the version is given")
