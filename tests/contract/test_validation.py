"""Semantic validation: every valid sample passes and survives a wire round-trip; each bad field
is rejected with INVALID_ARGUMENT naming that field."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from libs.contract import validation as v
from libs.contract.epd.v1 import chat_pb2, layout_pb2, media_pb2, service_info_pb2, tensor_pb2
from libs.contract.errors import InvalidArgument
from libs.contract.version import CONTRACT_MINOR, incompatibility
from tests.support import samples

pytestmark = pytest.mark.unit

VALIDATORS: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {
    "GenerateRequest": (samples.generate_request, v.validate_generate_request),
    "EncodeRequest": (samples.encode_request, v.validate_encode_request),
    "PrefillRequest": (samples.prefill_request, v.validate_prefill_request),
    "PrefillDecodeRequest": (samples.prefill_decode_request, v.validate_prefill_decode_request),
    "DecodeRequest": (samples.decode_request, v.validate_decode_request),
    "PagedDecodeRequest": (samples.paged_decode_request, v.validate_decode_request),
    "SpeechEncodeRequest": (samples.speech_encode_request, v.validate_encode_request),
    "SpeechPrefillRequest": (samples.speech_prefill_request, v.validate_prefill_request),
    "SpeechDecodeRequest": (samples.speech_decode_request, v.validate_decode_request),
    "ReleaseLeasesRequest": (samples.release_leases_request, v.validate_release_leases_request),
    "GetServiceInfoRequest": (samples.get_service_info_request, v.validate_get_service_info_request),
}


@pytest.mark.parametrize("name", sorted(VALIDATORS))
def test_valid_request_passes_and_round_trips(name: str) -> None:
    build, validate = VALIDATORS[name]
    request = build()
    validate(request)
    wire = request.SerializeToString()
    parsed = type(request).FromString(wire)
    assert parsed == request
    assert parsed.SerializeToString(deterministic=True) == request.SerializeToString(deterministic=True)
    validate(parsed)


@dataclass
class Bad:
    request: str
    mutate: Callable[[Any], None]
    field: str
    says: str


def _set(attr_path: str, value: Any) -> Callable[[Any], None]:
    def mutate(msg: Any) -> None:
        *parents, leaf = attr_path.split(".")
        for part in parents:
            msg = msg[int(part)] if part.isdigit() else getattr(msg, part)
        setattr(msg, leaf, value)

    return mutate


def _part(msg: Any, m: int, p: int) -> Any:
    return msg.messages[m].parts[p]


def _add_items(n: int) -> Callable[[Any], None]:
    def mutate(req: Any) -> None:
        del req.items[:]
        for i in range(n):
            req.items.add(item_index=i, media=samples.media())

    return mutate


def _clear_source(req: Any) -> None:
    _part(req, 1, 0).media.ClearField("data")


def _inline_media_at_prefill(req: Any) -> None:
    _part(req, 0, 0).media.CopyFrom(samples.media())


def _encoded_at_router(req: Any) -> None:
    _part(req, 1, 0).encoded.CopyFrom(samples.encoded_image())


def _wrong_arm(req: Any) -> None:
    layout = _part(req, 0, 0).encoded.layout
    layout.video.CopyFrom(layout_pb2.VideoLayout(grid_t=1, grid_h=1, grid_w=1))


def _rows_mismatch(req: Any) -> None:
    _part(req, 0, 0).encoded.layout.placeholder_token_count = 5


def _bad_nbytes(req: Any) -> None:
    _part(req, 0, 0).encoded.embeddings.tensors[0].spec.nbytes += 1


def _regions_short(req: Any) -> None:
    _part(req, 0, 0).encoded.embeddings.tensors[0].regions[0].length -= 4


def _dup_tensor(req: Any) -> None:
    tensors = _part(req, 0, 1).encoded.embeddings.tensors
    tensors.add().CopyFrom(tensors[0])


def _out_of_order(req: Any) -> None:
    _part(req, 0, 1).encoded.layout.item_index = 5


def _timestamps(req: Any) -> None:
    _part(req, 0, 1).encoded.layout.video.grid_timestamps_s.append(2.0)


def _audio_len(req: Any) -> None:
    _part(req, 0, 2).encoded.layout.audio.output_length = 7


def _kv_count(req: Any) -> None:
    del req.kv_cache.handle.tensors[-1]


def _kv_shape(req: Any) -> None:
    tensor = req.kv_cache.handle.tensors[1]
    tensor.spec.shape[1] = 11  # self-consistent (nbytes, regions), but not the layout's num_tokens
    tensor.spec.nbytes = tensor.regions[0].length = 2 * 11 * 4 * 2


def _too_many_media(req: Any) -> None:
    parts = req.messages[1].parts
    for _ in range(16):
        parts.add(media=samples.media())


def _inline_len(req: Any) -> None:
    handle = _part(req, 0, 0).encoded.embeddings
    handle.transport = tensor_pb2.TRANSPORT_KIND_INLINE
    handle.tensors[0].ClearField("regions")
    handle.tensors[0].inline_data = b"\x01" * 3


BAD = [
    # GenerateRequest
    Bad(
        "GenerateRequest",
        lambda r: r.messages[1].parts[0].media.__setattr__("modality", 0),
        "messages[1].parts[0].media.modality",
        "MODALITY_UNSPECIFIED",
    ),
    Bad("GenerateRequest", _set("messages.0.role", 0), "messages[0].role", "CHAT_ROLE_UNSPECIFIED"),
    Bad("GenerateRequest", lambda r: r.ClearField("messages"), "messages", "at least 1"),
    Bad("GenerateRequest", _clear_source, "messages[1].parts[0].media.source", "data or uri"),
    Bad("GenerateRequest", _encoded_at_router, "messages[1].parts[0].encoded", "not accepted"),
    Bad("GenerateRequest", _too_many_media, "messages[1].parts[17]", "more than 16 media items"),
    Bad("GenerateRequest", _set("sampling.top_p", 1.5), "sampling.top_p", "(0, 1]"),
    Bad("GenerateRequest", _set("sampling.max_tokens", -1), "sampling.max_tokens", "got -1"),
    Bad("GenerateRequest", lambda r: r.sampling.stop.append(""), "sampling.stop[1]", "empty"),
    Bad("GenerateRequest", _set("request_id", "has space"), "request_id", "letters, digits"),
    Bad(
        "GenerateRequest",
        lambda r: r.messages[1].parts[0].media.processor_options.__setattr__("min_pixels", 1 << 21),
        "messages[1].parts[0].media.processor_options.min_pixels",
        "exceeds max_pixels",
    ),
    Bad("GenerateRequest", _set("priority", 101), "priority", "[-100, 100]"),
    # EncodeRequest
    Bad("EncodeRequest", _set("request_id", ""), "request_id", "must not be empty"),
    Bad("EncodeRequest", _add_items(17), "items", "the limit is 16"),
    Bad("EncodeRequest", _set("items.1.item_index", 0), "items[1].item_index", "duplicate"),
    Bad("EncodeRequest", lambda r: r.items[0].ClearField("media"), "items[0].media", "required"),
    Bad("EncodeRequest", lambda r: r.ClearField("accepted_transports"), "accepted_transports", "at least 1"),
    Bad("EncodeRequest", lambda r: r.accepted_transports.append(0), "accepted_transports[2]", "UNSPECIFIED"),
    Bad("EncodeRequest", _set("cache_policy", 7), "cache_policy", "unknown CACHE_POLICY value 7"),
    Bad(
        "EncodeRequest",
        lambda r: r.items[0].media.__setattr__("data", b"x" * ((64 << 20) + 1)),
        "items[0].media.data",
        "the limit is",
    ),
    # PrefillRequest
    Bad("PrefillRequest", _inline_media_at_prefill, "messages[0].parts[0].media", "not accepted"),
    Bad("PrefillRequest", _wrong_arm, "messages[0].parts[0].encoded.layout.image", "required for MODALITY_IMAGE"),
    Bad(
        "PrefillRequest",
        _rows_mismatch,
        "messages[0].parts[0].encoded.embeddings.tensors[0].spec.shape",
        "placeholder_token_count=5",
    ),
    Bad(
        "PrefillRequest",
        _bad_nbytes,
        "messages[0].parts[0].encoded.embeddings.tensors[0].spec.nbytes",
        "does not match shape",
    ),
    Bad("PrefillRequest", _regions_short, "messages[0].parts[0].encoded.embeddings.tensors[0].regions", "lengths sum"),
    Bad("PrefillRequest", _dup_tensor, "messages[0].parts[1].encoded.embeddings.tensors[1].name", "duplicate"),
    Bad("PrefillRequest", _out_of_order, "messages[0].parts[1].encoded.layout.item_index", "in order"),
    Bad("PrefillRequest", _timestamps, "messages[0].parts[1].encoded.layout.video.grid_timestamps_s", "grid_t is 2"),
    Bad("PrefillRequest", _audio_len, "messages[0].parts[2].encoded.layout.audio.output_length", "does not match"),
    Bad(
        "PrefillRequest",
        _inline_len,
        "messages[0].parts[0].encoded.embeddings.tensors[0].inline_data",
        "spec.nbytes is 128",
    ),
    Bad(
        "PrefillRequest",
        lambda r: _part(r, 0, 0).encoded.embeddings.agent.__setattr__("agent_name", ""),
        "messages[0].parts[0].encoded.embeddings.agent.agent_name",
        "NIXL",
    ),
    Bad("PrefillRequest", lambda r: r.ClearField("accepted_kv_transports"), "accepted_kv_transports", "at least 1"),
    # PrefillDecodeRequest
    Bad(
        "PrefillDecodeRequest",
        lambda r: _part(r, 0, 0).encoded.layout.__setattr__("mm_hash", ""),
        "messages[0].parts[0].encoded.layout.mm_hash",
        "empty",
    ),
    Bad(
        "PrefillDecodeRequest",
        lambda r: _part(r, 0, 0).encoded.layout.image.__setattr__("grid_h", -2),
        "messages[0].parts[0].encoded.layout.image.grid_h",
        "got -2",
    ),
    Bad("PrefillDecodeRequest", _set("sampling.temperature", float("nan")), "sampling.temperature", "[0, 100]"),
    # DecodeRequest
    Bad("DecodeRequest", lambda r: r.ClearField("kv_cache"), "kv_cache", "required"),
    Bad("DecodeRequest", _kv_count, "kv_cache.handle.tensors", "2 * num_layers is 4"),
    Bad("DecodeRequest", _kv_shape, "kv_cache.handle.tensors[1].spec.shape", "!="),
    Bad("DecodeRequest", _set("kv_cache.layout.num_layers", 0), "kv_cache.layout.num_layers", "> 0"),
    Bad(
        "DecodeRequest",
        _set("kv_cache.handle.tensors.0.spec.dtype", 0),
        "kv_cache.handle.tensors[0].spec.dtype",
        "D_TYPE_UNSPECIFIED",
    ),
    Bad(
        "DecodeRequest",
        _set("kv_cache.handle.tensors.0.regions.0.memory_kind", 0),
        "kv_cache.handle.tensors[0].regions[0].memory_kind",
        "MEMORY_KIND_UNSPECIFIED",
    ),
    Bad("DecodeRequest", _set("decode_state.prompt_tokens", 12), "kv_cache.layout.num_tokens", "implies 12"),
    Bad("DecodeRequest", _set("decode_state.generated_tokens", 0), "decode_state.generated_tokens", ">= 1"),
    Bad("DecodeRequest", _set("sampling.top_k", -1), "sampling.top_k", ">= 0"),
    Bad("DecodeRequest", _set("priority", -101), "priority", "got -101"),
    # DecodeRequest with a paged KV cache (contract 1.3)
    Bad(
        "PagedDecodeRequest",
        lambda r: r.kv_cache.handle.CopyFrom(samples.kv_cache().handle),
        "kv_cache.handle",
        "exactly one of handle and paged",
    ),
    Bad(
        "PagedDecodeRequest",
        lambda r: r.decode_state.ClearField("engine_prompt"),
        "decode_state.engine_prompt",
        "required",
    ),
    Bad("PagedDecodeRequest", _set("kv_cache.paged.side_channel_port", 0), "kv_cache.paged.side_channel_port", "65535"),
    Bad("PagedDecodeRequest", _set("kv_cache.paged.engine_id", ""), "kv_cache.paged.engine_id", "required"),
    Bad("PagedDecodeRequest", _set("kv_cache.paged.transfer_mode", 0), "kv_cache.paged.transfer_mode", "UNSPECIFIED"),
    Bad("PagedDecodeRequest", lambda r: r.kv_cache.paged.ClearField("groups"), "kv_cache.paged.groups", "at least 1"),
    Bad(
        "PagedDecodeRequest",
        lambda r: r.kv_cache.paged.groups[0].block_ids.append(-1),
        "kv_cache.paged.groups[0].block_ids",
        ">= 0",
    ),
    Bad(
        "PagedDecodeRequest",
        _set("kv_cache.paged.tensor_parallel_size", 0),
        "kv_cache.paged.tensor_parallel_size",
        ">= 1",
    ),
    Bad(
        "PagedDecodeRequest",
        lambda r: r.decode_state.engine_prompt.ClearField("token_ids"),
        "decode_state.engine_prompt.token_ids",
        "at least 1",
    ),
    Bad(
        "PagedDecodeRequest",
        _set("decode_state.engine_prompt.items.0.mm_hash", ""),
        "decode_state.engine_prompt.items[0].mm_hash",
        "empty",
    ),
    # Encoder-decoder speech (contract 1.4)
    Bad(
        "SpeechEncodeRequest",
        _set("items.0.media.processor_options.audio_window_start_frame", -1),
        "items[0].media.processor_options.audio_window_start_frame",
        ">= 0",
    ),
    Bad(
        "SpeechPrefillRequest",
        _set("messages.0.parts.0.encoded.layout.placeholder_token_count", 6),
        "messages[0].parts[0].encoded.layout.placeholder_token_count",
        "must be 0 with cross_attention_rows",
    ),
    Bad(
        "SpeechPrefillRequest",
        _set("messages.0.parts.0.encoded.layout.cross_attention_rows", 7),
        "messages[0].parts[0].encoded.layout.audio.output_length",
        "cross_attention_rows 7",
    ),
    Bad(
        "SpeechPrefillRequest",
        _set("messages.0.parts.0.encoded.layout.audio.window_frames", 3000),
        "messages[0].parts[0].encoded.layout.audio.window_frames",
        "ends past clip_frames",
    ),
    Bad("SpeechDecodeRequest", _set("kv_cache.layout.cross_tokens", 7), "kv_cache.handle.tensors[4].spec.shape", "!="),
    Bad("SpeechDecodeRequest", _set("kv_cache.layout.cross_tokens", 0), "kv_cache.handle.tensors", "2 * num_layers"),
    Bad(
        "DecodeRequest",
        lambda r: setattr(r.kv_cache.handle.tensors[0], "name", "layers.0.cross_key"),
        "kv_cache.handle.tensors[0].name",
        "not layers",
    ),
    # Contract 1.6's sampling fields, with vLLM's ranges.
    Bad("GenerateRequest", _set("sampling.presence_penalty", 2.5), "sampling.presence_penalty", "[-2, 2]"),
    Bad("GenerateRequest", _set("sampling.frequency_penalty", float("nan")), "sampling.frequency_penalty", "[-2, 2]"),
    Bad("PrefillRequest", _set("sampling.frequency_penalty", -2.5), "sampling.frequency_penalty", "[-2, 2]"),
    Bad("GenerateRequest", _set("sampling.repetition_penalty", 0.0), "sampling.repetition_penalty", "(0, 10]"),
    Bad("DecodeRequest", _set("sampling.repetition_penalty", 11.0), "sampling.repetition_penalty", "(0, 10]"),
    Bad("GenerateRequest", _set("sampling.min_tokens", -1), "sampling.min_tokens", "at most max_tokens"),
    Bad("PrefillDecodeRequest", _set("sampling.min_tokens", 10_000), "sampling.min_tokens", "at most max_tokens"),
    Bad("GenerateRequest", _set("sampling.logprobs", 21), "sampling.logprobs", "[0, 20]"),
    Bad("GenerateRequest", _set("sampling.logprobs", -1), "sampling.logprobs", "[0, 20]"),
    Bad(
        "DecodeRequest",
        lambda r: r.decode_state.prompt_token_ids.extend([1, 2]),
        "decode_state.prompt_token_ids",
        "prompt_tokens is",
    ),
    # ReleaseLeasesRequest
    Bad("ReleaseLeasesRequest", _set("reason", 0), "reason", "RELEASE_REASON_UNSPECIFIED"),
    Bad("ReleaseLeasesRequest", lambda r: r.lease_ids.append(""), "lease_ids[2]", "empty"),
    Bad("ReleaseLeasesRequest", lambda r: r.ClearField("lease_ids"), "lease_ids", "at least 1"),
    # GetServiceInfoRequest
    Bad("GetServiceInfoRequest", _set("caller_contract_version.major", 0), "caller_contract_version.major", ">= 1"),
]


@pytest.mark.parametrize("bad", BAD, ids=[f"{b.request}:{b.field}" for b in BAD])
def test_bad_field_is_named(bad: Bad) -> None:
    build, validate = VALIDATORS[bad.request]
    request = build()
    bad.mutate(request)
    with pytest.raises(InvalidArgument) as caught:
        validate(request)
    assert caught.value.field == bad.field
    assert bad.says in caught.value.problem
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_every_request_type_has_a_bad_field_case() -> None:
    assert {b.request for b in BAD} == set(VALIDATORS)


def test_limits_are_configurable() -> None:
    request = samples.encode_request()
    with pytest.raises(InvalidArgument, match="the limit is 1"):
        v.validate_encode_request(request, v.Limits(max_media_items=1))


def test_dtype_sizes_cover_every_dtype() -> None:
    assert set(v.DTYPE_SIZES) == set(tensor_pb2.DType.values()) - {tensor_pb2.D_TYPE_UNSPECIFIED}


def test_text_only_prefill_needs_no_media() -> None:
    request = samples.prefill_request()
    del request.messages[:]
    request.messages.add(role=chat_pb2.CHAT_ROLE_USER).parts.add(text="no media at all")
    v.validate_prefill_request(request)  # no encoded part, so no handle or layout to check: valid
    # The conversation is still checked: a part with nothing in it next to the text is refused.
    request.messages[0].parts.add()
    with pytest.raises(InvalidArgument) as caught:
        v.validate_prefill_request(request)
    assert caught.value.field == "messages[0].parts[1].kind"


def test_uri_source_is_accepted() -> None:
    request = samples.generate_request()
    media = request.messages[1].parts[0].media
    media.uri = "file:///tmp/cat.png"  # replaces the inline bytes (one source)
    v.validate_generate_request(request)
    # The URI itself is checked: present and bounded.
    for uri, says in (("", "must not be empty"), ("file:///" + "x" * 4096, "the limit is 4096")):
        media.uri = uri
        with pytest.raises(InvalidArgument) as caught:
            v.validate_generate_request(request)
        assert (caught.value.field, says in caught.value.problem) == ("messages[1].parts[0].media.uri", True)


def test_unknown_enum_value_is_named() -> None:
    request = samples.generate_request()
    request.messages[1].parts[0].media.modality = 99  # a value from a newer contract
    with pytest.raises(InvalidArgument, match="unknown MODALITY value 99"):
        v.validate_generate_request(request)


def test_image_layout_with_wrong_modality_arm() -> None:
    item = samples.encoded_image()
    item.layout.modality = media_pb2.MODALITY_AUDIO
    with pytest.raises(InvalidArgument) as caught:
        v.validate_encoded_media(item, "item", v.DEFAULT_LIMITS)
    assert caught.value.field == "item.layout.audio"


def test_version_compatibility_is_decided_by_major() -> None:
    assert incompatibility(service_info_pb2.ContractVersion(major=1, minor=7)) is None
    reason = incompatibility(service_info_pb2.ContractVersion(major=2, minor=0))
    assert reason is not None and "peer speaks 2.0" in reason and f"this service speaks 1.{CONTRACT_MINOR}" in reason


def test_min_tokens_is_bounded_by_the_requests_max_tokens() -> None:
    build, validate = VALIDATORS["GenerateRequest"]
    request = build()
    request.sampling.max_tokens = 8
    request.sampling.min_tokens = 8
    validate(request)
    request.sampling.min_tokens = 9
    with pytest.raises(InvalidArgument, match="at most max_tokens"):
        validate(request)
