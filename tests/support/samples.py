"""Valid, fully populated epd.v1 requests, one builder per request type. Tests mutate copies."""

from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp

from libs.contract import version
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

PNG_BYTES = b"\x89PNG\r\n\x1a\n" + bytes(range(64))
WIDTH = 8


def sampling() -> sampling_pb2.SamplingParams:
    return sampling_pb2.SamplingParams(
        temperature=0.7, top_p=0.9, top_k=20, seed=1234, max_tokens=32, stop=["\n\n"], stop_token_ids=[2]
    )


def media(modality: int = media_pb2.MODALITY_IMAGE) -> media_pb2.MediaItem:
    return media_pb2.MediaItem(
        modality=modality,
        data=PNG_BYTES,
        mime_type="image/png",
        id="client-item-1",
        processor_options=media_pb2.ProcessorOptions(min_pixels=3136, max_pixels=1 << 20),
    )


def nixl_handle(rows: int, lease_id: str = "lease-1") -> tensor_pb2.TensorHandle:
    nbytes = rows * WIDTH * 4
    return tensor_pb2.TensorHandle(
        transport=tensor_pb2.TRANSPORT_KIND_NIXL,
        agent=tensor_pb2.NixlAgentRef(agent_name="encoder-0", instance_id="a1b2", producer_address="127.0.0.1:50051"),
        lease_id=lease_id,
        lease_expire_time=Timestamp(seconds=1_900_000_000),
        tensors=[
            tensor_pb2.TensorDescriptor(
                name="embeddings",
                spec=tensor_pb2.TensorSpec(
                    shape=[rows, WIDTH],
                    dtype=tensor_pb2.D_TYPE_FLOAT32,
                    nbytes=nbytes,
                    layout=tensor_pb2.TENSOR_LAYOUT_ROW_MAJOR,
                ),
                regions=[
                    tensor_pb2.MemoryRegion(
                        address=0x7F00_0000_0000, length=nbytes, device_id=0, memory_kind=tensor_pb2.MEMORY_KIND_CPU
                    )
                ],
                checksum=tensor_pb2.Checksum(algorithm=tensor_pb2.CHECKSUM_ALGORITHM_CRC32, value=0xDEADBEEF),
            )
        ],
    )


def encoded_image(item_index: int = 0) -> layout_pb2.EncodedMedia:
    return layout_pb2.EncodedMedia(
        layout=layout_pb2.ItemLayout(
            modality=media_pb2.MODALITY_IMAGE,
            item_index=item_index,
            mm_hash="9f" * 32,
            placeholder_token_count=4,
            image=layout_pb2.ImageLayout(grid_t=1, grid_h=4, grid_w=4),
        ),
        embeddings=nixl_handle(rows=4, lease_id=f"lease-{item_index}"),
    )


def encoded_video(item_index: int) -> layout_pb2.EncodedMedia:
    return layout_pb2.EncodedMedia(
        layout=layout_pb2.ItemLayout(
            modality=media_pb2.MODALITY_VIDEO,
            item_index=item_index,
            mm_hash="ab" * 32,
            placeholder_token_count=8,
            video=layout_pb2.VideoLayout(
                grid_t=2, grid_h=4, grid_w=4, seconds_per_grid=1.0, grid_timestamps_s=[0.0, 1.0], sampled_frames=4
            ),
        ),
        embeddings=nixl_handle(rows=8, lease_id=f"lease-{item_index}"),
    )


def encoded_audio(item_index: int) -> layout_pb2.EncodedMedia:
    return layout_pb2.EncodedMedia(
        layout=layout_pb2.ItemLayout(
            modality=media_pb2.MODALITY_AUDIO,
            item_index=item_index,
            mm_hash="cd" * 32,
            placeholder_token_count=6,
            audio=layout_pb2.AudioLayout(feature_length=200, output_length=6, duration_s=2.0),
        ),
        embeddings=nixl_handle(rows=6, lease_id=f"lease-{item_index}"),
    )


def _text(text: str) -> chat_pb2.ContentPart:
    return chat_pb2.ContentPart(text=text)


def generate_request() -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        request_id="req-1",
        messages=[
            chat_pb2.ChatMessage(role=chat_pb2.CHAT_ROLE_SYSTEM, parts=[_text("Be brief.")]),
            chat_pb2.ChatMessage(
                role=chat_pb2.CHAT_ROLE_USER,
                parts=[chat_pb2.ContentPart(media=media()), _text("What is in the image?")],
            ),
        ],
        sampling=sampling(),
    )


def encode_request() -> encoder_pb2.EncodeRequest:
    return encoder_pb2.EncodeRequest(
        request_id="req-1",
        items=[
            encoder_pb2.EncodeItem(item_index=0, media=media()),
            encoder_pb2.EncodeItem(item_index=1, media=media()),
        ],
        accepted_transports=[tensor_pb2.TRANSPORT_KIND_NIXL, tensor_pb2.TRANSPORT_KIND_INLINE],
        cache_policy=encoder_pb2.CACHE_POLICY_CACHED_ONLY,
    )


def _metadata_only_messages() -> list[chat_pb2.ChatMessage]:
    return [
        chat_pb2.ChatMessage(
            role=chat_pb2.CHAT_ROLE_USER,
            parts=[
                chat_pb2.ContentPart(encoded=encoded_image(0)),
                chat_pb2.ContentPart(encoded=encoded_video(1)),
                chat_pb2.ContentPart(encoded=encoded_audio(2)),
                _text("Describe all three."),
            ],
        )
    ]


def prefill_request() -> prefill_pb2.PrefillRequest:
    return prefill_pb2.PrefillRequest(
        request_id="req-1",
        messages=_metadata_only_messages(),
        sampling=sampling(),
        accepted_kv_transports=[tensor_pb2.TRANSPORT_KIND_NIXL],
    )


def prefill_decode_request() -> prefill_decode_pb2.PrefillDecodeRequest:
    return prefill_decode_pb2.PrefillDecodeRequest(
        request_id="req-1", messages=_metadata_only_messages(), sampling=sampling()
    )


def kv_cache(num_layers: int = 2, heads: int = 2, tokens: int = 10, head_dim: int = 4) -> prefill_pb2.KvCache:
    nbytes = heads * tokens * head_dim * 2
    tensors = []
    for layer in range(num_layers):
        for kind in ("key", "value"):
            tensors.append(
                tensor_pb2.TensorDescriptor(
                    name=f"layers.{layer}.{kind}",
                    spec=tensor_pb2.TensorSpec(
                        shape=[heads, tokens, head_dim],
                        dtype=tensor_pb2.D_TYPE_BFLOAT16,
                        nbytes=nbytes,
                        layout=tensor_pb2.TENSOR_LAYOUT_ROW_MAJOR,
                    ),
                    regions=[
                        tensor_pb2.MemoryRegion(
                            address=0x1000 * (len(tensors) + 1), length=nbytes, memory_kind=tensor_pb2.MEMORY_KIND_CPU
                        )
                    ],
                )
            )
    return prefill_pb2.KvCache(
        layout=prefill_pb2.KvCacheLayout(
            num_layers=num_layers,
            num_kv_heads=heads,
            head_dim=head_dim,
            num_tokens=tokens,
            dtype=tensor_pb2.D_TYPE_BFLOAT16,
        ),
        handle=tensor_pb2.TensorHandle(
            transport=tensor_pb2.TRANSPORT_KIND_NIXL,
            agent=tensor_pb2.NixlAgentRef(agent_name="prefill-0", instance_id="p1", producer_address="127.0.0.1:50061"),
            lease_id="kv-lease-1",
            lease_expire_time=Timestamp(seconds=1_900_000_000),
            tensors=tensors,
        ),
    )


def decode_request() -> decode_pb2.DecodeRequest:
    return decode_pb2.DecodeRequest(
        request_id="req-1",
        kv_cache=kv_cache(tokens=10),
        decode_state=prefill_pb2.DecodeState(
            next_input_token_id=42, rope_delta=-3, generated_tokens=1, generated_text="The", prompt_tokens=10
        ),
        sampling=sampling(),
    )


def paged_decode_request() -> decode_pb2.DecodeRequest:
    """Since 1.3: decode from KV left in a vLLM prefill engine's blocks, with the engine's prompt."""
    request = decode_request()
    request.kv_cache.ClearField("handle")
    request.kv_cache.layout.dtype = tensor_pb2.D_TYPE_FLOAT32
    request.kv_cache.paged.CopyFrom(
        prefill_pb2.PagedKvBlocks(
            producer_address="127.0.0.1:50071",
            lease_id="req-1-0a1b2c3d",
            lease_expire_time=Timestamp(seconds=1_900_000_000),
            engine_id="epd-prefill-5f3e2d1c0b9a",
            engine_request_id="req-1-0a1b2c3d",
            side_channel_host="127.0.0.1",
            side_channel_port=45611,
            groups=[prefill_pb2.KvBlockIds(block_ids=[7, 8, 12])],
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            decode_context_parallel_size=1,
            transfer_mode=prefill_pb2.KV_TRANSFER_MODE_PULL,
        )
    )
    request.decode_state.engine_prompt.CopyFrom(
        prefill_pb2.EnginePrompt(token_ids=[151644, 872, 198, 151655, 151645], items=[encoded_image(0).layout])
    )
    return request


def encoded_speech_window() -> layout_pb2.EncodedMedia:
    """Since 1.4: one Whisper window (the second of a 41.5 s clip): encoder states the decoder
    cross-attends to, no prompt positions."""
    return layout_pb2.EncodedMedia(
        layout=layout_pb2.ItemLayout(
            modality=media_pb2.MODALITY_AUDIO,
            item_index=0,
            mm_hash="ef" * 32,
            audio=layout_pb2.AudioLayout(
                feature_length=3000,
                output_length=6,
                duration_s=41.5,
                window_start_frame=2948,
                window_frames=1202,
                clip_frames=4150,
            ),
            cross_attention_rows=6,
        ),
        embeddings=nixl_handle(rows=6),
    )


def speech_prefill_request() -> prefill_pb2.PrefillRequest:
    """Since 1.4: prefill of one Whisper window, with timestamps."""
    request = prefill_request()
    del request.messages[:]
    request.messages.append(
        chat_pb2.ChatMessage(
            role=chat_pb2.CHAT_ROLE_USER, parts=[chat_pb2.ContentPart(encoded=encoded_speech_window())]
        )
    )
    request.sampling.timestamps = True
    return request


def speech_encode_request() -> encoder_pb2.EncodeRequest:
    """Since 1.4: encode the window of a long clip that starts at frame 2948."""
    item = media(media_pb2.MODALITY_AUDIO)
    item.processor_options.Clear()
    item.processor_options.audio_window_start_frame = 2948
    return encoder_pb2.EncodeRequest(
        request_id="req-1",
        items=[encoder_pb2.EncodeItem(item_index=0, media=item)],
        accepted_transports=[tensor_pb2.TRANSPORT_KIND_NIXL],
    )


def cross_attention_kv_cache(cross_tokens: int = 6) -> prefill_pb2.KvCache:
    """Since 1.4: an encoder-decoder cache: self- and cross-attention key and value per layer."""
    kv = kv_cache(tokens=10)
    kv.layout.cross_tokens = cross_tokens
    for source in list(kv.handle.tensors):
        cross = kv.handle.tensors.add()
        cross.CopyFrom(source)
        cross.name = source.name.replace(".key", ".cross_key").replace(".value", ".cross_value")
        cross.spec.nbytes = cross.regions[0].length = source.spec.nbytes // source.spec.shape[1] * cross_tokens
        cross.spec.shape[1] = cross_tokens
        cross.regions[0].address += 0x100000
    return kv


def speech_decode_request() -> decode_pb2.DecodeRequest:
    request = decode_request()
    request.kv_cache.CopyFrom(cross_attention_kv_cache())
    request.sampling.timestamps = True
    return request


def release_leases_request() -> lease_pb2.ReleaseLeasesRequest:
    return lease_pb2.ReleaseLeasesRequest(lease_ids=["lease-0", "lease-1"], reason=lease_pb2.RELEASE_REASON_ABANDONED)


def get_service_info_request() -> service_info_pb2.GetServiceInfoRequest:
    return service_info_pb2.GetServiceInfoRequest(
        caller_contract_version=service_info_pb2.ContractVersion(major=1, minor=0)
    )


def service_info() -> service_info_pb2.ServiceInfo:
    """An encoder's ServiceInfo at today's contract version (what an EpdServer under test serves)."""
    return service_info_pb2.ServiceInfo(
        contract_version=version.current(),
        role=service_info_pb2.SERVICE_ROLE_ENCODER,
        instance_id="inst-1",
        model=service_info_pb2.ModelIdentity(model_id="tiny", revision="local", weights_digest="00"),
    )
