"""The messages contract v1.9 wrote on the wire: one per RPC request and response type.

Frozen with the v1.9 snapshot. `proto/wirevectors.py` serializes them with the snapshot's generated
code (`libs.contract.snapshots.v1_9`) into `<full name>.binpb`, plus a `.txtpb` of the same message.
Requests are valid for the v1.9 validation rules; together the messages set every field of every
v1.9 message to a non-default value, except those in `UNPOPULATED`. Deterministic: no clock, no
randomness.
"""

from __future__ import annotations

from google.protobuf.message import Message

from libs.contract.snapshots.v1_9.epd.v1 import (
    chat_pb2,
    decode_pb2,
    encoder_pb2,
    generate_pb2,
    generation_pb2,
    layout_pb2,
    lease_pb2,
    media_pb2,
    prefill_decode_pb2,
    prefill_pb2,
    sampling_pb2,
    service_info_pb2,
    stats_pb2,
    tensor_pb2,
)

# Fields no v1.9 message sets to a non-default value, with the reason.
UNPOPULATED: dict[str, str] = {}

LEASE_EXPIRY_S = 1_900_000_000
WIDTH = 8


def _sampling() -> sampling_pb2.SamplingParams:
    return sampling_pb2.SamplingParams(
        temperature=0.5,
        top_p=0.875,
        top_k=20,
        seed=1234,
        max_tokens=32,
        stop=["\n\n", "END"],
        stop_token_ids=[2, 7],
        timestamps=True,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.125,
        min_tokens=4,
        ignore_eos=True,
        logprobs=2,
    )


def _image() -> media_pb2.MediaItem:
    return media_pb2.MediaItem(
        modality=media_pb2.MODALITY_IMAGE,
        data=b"\x89PNG\r\n\x1a\n" + bytes(range(32)),
        mime_type="image/png",
        id="client-image-1",
        processor_options=media_pb2.ProcessorOptions(min_pixels=3136, max_pixels=1 << 20),
    )


def _video() -> media_pb2.MediaItem:
    return media_pb2.MediaItem(
        modality=media_pb2.MODALITY_VIDEO,
        uri="file:///srv/media/clip.mp4",
        mime_type="video/mp4",
        id="client-video-1",
        processor_options=media_pb2.ProcessorOptions(
            min_pixels=3136, max_pixels=1 << 18, video_fps=2.0, video_max_frames=16
        ),
    )


def _audio() -> media_pb2.MediaItem:
    """Since 1.4: the second 30 s window of a long clip (Whisper)."""
    return media_pb2.MediaItem(
        modality=media_pb2.MODALITY_AUDIO,
        uri="file:///srv/media/clip.wav",
        id="client-audio-1",
        processor_options=media_pb2.ProcessorOptions(audio_window_start_frame=2948),
    )


def _nixl_handle(rows: int, lease_id: str, base: int) -> tensor_pb2.TensorHandle:
    nbytes = rows * WIDTH * 4
    handle = tensor_pb2.TensorHandle(
        transport=tensor_pb2.TRANSPORT_KIND_NIXL,
        agent=tensor_pb2.NixlAgentRef(agent_name="encoder-0", instance_id="a1b2", producer_address="127.0.0.1:50051"),
        lease_id=lease_id,
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
                        address=base, length=nbytes // 2, device_id=1, memory_kind=tensor_pb2.MEMORY_KIND_GPU
                    ),
                    tensor_pb2.MemoryRegion(
                        address=base + 0x10000, length=nbytes // 2, memory_kind=tensor_pb2.MEMORY_KIND_CPU
                    ),
                ],
                checksum=tensor_pb2.Checksum(algorithm=tensor_pb2.CHECKSUM_ALGORITHM_CRC32, value=0xDEADBEEF),
            )
        ],
    )
    handle.lease_expire_time.seconds = LEASE_EXPIRY_S
    handle.lease_expire_time.nanos = 250_000_000
    return handle


def _inline_handle(rows: int, lease_id: str) -> tensor_pb2.TensorHandle:
    nbytes = rows * WIDTH * 2
    return tensor_pb2.TensorHandle(
        transport=tensor_pb2.TRANSPORT_KIND_INLINE,
        lease_id=lease_id,
        tensors=[
            tensor_pb2.TensorDescriptor(
                name="embeddings",
                spec=tensor_pb2.TensorSpec(
                    shape=[rows, WIDTH],
                    dtype=tensor_pb2.D_TYPE_BFLOAT16,
                    nbytes=nbytes,
                    layout=tensor_pb2.TENSOR_LAYOUT_ROW_MAJOR,
                ),
                inline_data=bytes(i % 251 for i in range(nbytes)),
            )
        ],
    )


def _encoded_image(item_index: int) -> layout_pb2.EncodedMedia:
    return layout_pb2.EncodedMedia(
        layout=layout_pb2.ItemLayout(
            modality=media_pb2.MODALITY_IMAGE,
            item_index=item_index,
            mm_hash="9f" * 32,
            placeholder_token_count=4,
            image=layout_pb2.ImageLayout(grid_t=1, grid_h=4, grid_w=4),
        ),
        embeddings=_nixl_handle(rows=4, lease_id=f"lease-{item_index}", base=0x7F00_0000_0000),
    )


def _encoded_video(item_index: int) -> layout_pb2.EncodedMedia:
    return layout_pb2.EncodedMedia(
        layout=layout_pb2.ItemLayout(
            modality=media_pb2.MODALITY_VIDEO,
            item_index=item_index,
            mm_hash="ab" * 32,
            placeholder_token_count=8,
            video=layout_pb2.VideoLayout(
                grid_t=2, grid_h=4, grid_w=4, seconds_per_grid=1.0, grid_timestamps_s=[0.25, 1.25], sampled_frames=4
            ),
        ),
        embeddings=_nixl_handle(rows=8, lease_id=f"lease-{item_index}", base=0x7F00_0010_0000),
    )


def _encoded_audio(item_index: int) -> layout_pb2.EncodedMedia:
    """Since 1.4: an encoder-decoder (Whisper) window: encoder states for cross-attention, no
    prompt positions."""
    return layout_pb2.EncodedMedia(
        layout=layout_pb2.ItemLayout(
            modality=media_pb2.MODALITY_AUDIO,
            item_index=item_index,
            mm_hash="cd" * 32,
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
        embeddings=_inline_handle(rows=6, lease_id=f"lease-{item_index}"),
    )


def _held_image(item_index: int) -> layout_pb2.EncodedMedia:
    """Since 1.9: an item the router expects the member's prefix cache to hold: layout, no handle."""
    return layout_pb2.EncodedMedia(layout=_encoded_image(item_index).layout, prefix_held=True)


def _metadata_only() -> list[chat_pb2.ChatMessage]:
    return [
        chat_pb2.ChatMessage(role=chat_pb2.CHAT_ROLE_SYSTEM, parts=[chat_pb2.ContentPart(text="Be brief.")]),
        chat_pb2.ChatMessage(
            role=chat_pb2.CHAT_ROLE_USER,
            parts=[
                chat_pb2.ContentPart(encoded=_encoded_image(0)),
                chat_pb2.ContentPart(encoded=_encoded_video(1)),
                chat_pb2.ContentPart(encoded=_encoded_audio(2)),
                chat_pb2.ContentPart(text="Describe all three."),
            ],
        ),
        chat_pb2.ChatMessage(role=chat_pb2.CHAT_ROLE_ASSISTANT, parts=[chat_pb2.ContentPart(text="Sure.")]),
        chat_pb2.ChatMessage(
            role=chat_pb2.CHAT_ROLE_USER,
            parts=[chat_pb2.ContentPart(encoded=_held_image(3)), chat_pb2.ContentPart(text="And this one?")],
        ),
    ]


def _kv_cache(
    num_layers: int = 2, heads: int = 2, tokens: int = 10, head_dim: int = 4, cross_tokens: int = 6
) -> prefill_pb2.KvCache:
    """Since 1.4 with cross-attention tensors (an encoder-decoder model's cache)."""
    nbytes = heads * tokens * head_dim * 2
    cross_nbytes = heads * cross_tokens * head_dim * 2
    tensors = [
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
                    address=0x1000 * (2 * layer + k + 1), length=nbytes, memory_kind=tensor_pb2.MEMORY_KIND_CPU
                )
            ],
        )
        for layer in range(num_layers)
        for k, kind in enumerate(("key", "value"))
    ] + [
        tensor_pb2.TensorDescriptor(
            name=f"layers.{layer}.{kind}",
            spec=tensor_pb2.TensorSpec(
                shape=[heads, cross_tokens, head_dim],
                dtype=tensor_pb2.D_TYPE_BFLOAT16,
                nbytes=cross_nbytes,
                layout=tensor_pb2.TENSOR_LAYOUT_ROW_MAJOR,
            ),
            regions=[
                tensor_pb2.MemoryRegion(
                    address=0x100000 + 0x1000 * (2 * layer + k),
                    length=cross_nbytes,
                    memory_kind=tensor_pb2.MEMORY_KIND_CPU,
                )
            ],
        )
        for layer in range(num_layers)
        for k, kind in enumerate(("cross_key", "cross_value"))
    ]
    handle = tensor_pb2.TensorHandle(
        transport=tensor_pb2.TRANSPORT_KIND_NIXL,
        agent=tensor_pb2.NixlAgentRef(agent_name="prefill-0", instance_id="p1", producer_address="127.0.0.1:50061"),
        lease_id="kv-lease-1",
        tensors=tensors,
    )
    handle.lease_expire_time.seconds = LEASE_EXPIRY_S
    return prefill_pb2.KvCache(
        layout=prefill_pb2.KvCacheLayout(
            num_layers=num_layers,
            num_kv_heads=heads,
            head_dim=head_dim,
            num_tokens=tokens,
            dtype=tensor_pb2.D_TYPE_BFLOAT16,
            cross_tokens=cross_tokens,
        ),
        handle=handle,
    )


def _decode_state() -> prefill_pb2.DecodeState:
    return prefill_pb2.DecodeState(
        next_input_token_id=42,
        rope_delta=-3,
        generated_tokens=1,
        generated_text="The",
        prompt_tokens=10,
        prompt_token_ids=[151644, 872, 198, 151652, 151655, 151655, 151653, 3838, 151645, 198],  # since 1.6
        cached_prompt_tokens=4,  # since 1.8
        cache_salt="tenant-a",  # since 1.9
    )


def _paged_kv_cache() -> prefill_pb2.KvCache:
    """Since 1.3: the KV left in a vLLM prefill engine's blocks (one group of 3 blocks of 4 tokens)."""
    paged = prefill_pb2.PagedKvBlocks(
        producer_address="127.0.0.1:50071",
        lease_id="req-1-0a1b2c3d",
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
    paged.lease_expire_time.seconds = LEASE_EXPIRY_S
    paged.lease_expire_time.nanos = 500_000_000
    return prefill_pb2.KvCache(
        layout=prefill_pb2.KvCacheLayout(
            num_layers=2, num_kv_heads=2, head_dim=32, num_tokens=10, dtype=tensor_pb2.D_TYPE_FLOAT32
        ),
        paged=paged,
    )


def _engine_decode_state() -> prefill_pb2.DecodeState:
    """Since 1.3: with a paged KV cache, the prompt as the prefill engine took it (one image)."""
    state = _decode_state()
    image = _encoded_image(0).layout
    state.engine_prompt.CopyFrom(prefill_pb2.EnginePrompt(token_ids=[151644, 872, 198, 151655, 151645], items=[image]))
    return state


def _chunk(finish: int = generation_pb2.FINISH_REASON_UNSPECIFIED) -> generation_pb2.TokenChunk:
    # Since 1.6: one TokenLogprobs per token id, the 2 most likely alternatives each.
    def lp(token_id: int, logprob: float, token: str) -> generation_pb2.TokenLogprob:
        return generation_pb2.TokenLogprob(token_id=token_id, logprob=logprob, token=token)

    return generation_pb2.TokenChunk(
        token_ids=[791, 2168],
        text=" cat sits",
        finish_reason=finish,
        logprobs=[
            generation_pb2.TokenLogprobs(
                chosen=lp(791, -0.25, " cat"), top=[lp(791, -0.25, " cat"), lp(5679, -1.5, " dog")]
            ),
            generation_pb2.TokenLogprobs(
                chosen=lp(2168, -2.0, " sits"), top=[lp(374, -0.5, " is"), lp(2168, -2.0, " sits")]
            ),
        ],
    )


def _usage() -> generation_pb2.Usage:
    return generation_pb2.Usage(prompt_tokens=10, completion_tokens=3, cached_prompt_tokens=4)  # cached: 1.8


def _service_info() -> service_info_pb2.ServiceInfo:
    return service_info_pb2.ServiceInfo(
        contract_version=service_info_pb2.ContractVersion(major=1, minor=7),
        model=service_info_pb2.ModelIdentity(model_id="qwen2_5_omni-tiny", revision="local", weights_digest="0f" * 32),
        role=service_info_pb2.SERVICE_ROLE_ENCODER,
        embedding_specs=[
            service_info_pb2.EmbeddingSpec(
                modality=media_pb2.MODALITY_IMAGE,
                width=WIDTH,
                dtype=tensor_pb2.D_TYPE_FLOAT32,
                extra_tensors=[
                    service_info_pb2.ExtraTensorSpec(name="deepstack.0", width=WIDTH, dtype=tensor_pb2.D_TYPE_FLOAT32)
                ],
            ),
            service_info_pb2.EmbeddingSpec(
                modality=media_pb2.MODALITY_AUDIO, width=WIDTH, dtype=tensor_pb2.D_TYPE_BFLOAT16
            ),
        ],
        transports=[
            service_info_pb2.TransportInfo(
                kind=tensor_pb2.TRANSPORT_KIND_NIXL,
                nixl=service_info_pb2.NixlAgentInfo(
                    agent_name="encoder-0", instance_id="a1b2", metadata=b"\x00nixl\xff" * 4
                ),
            ),
            service_info_pb2.TransportInfo(kind=tensor_pb2.TRANSPORT_KIND_INLINE),
        ],
        instance_id="a1b2",
        capabilities=["checksum.crc32", "admission.priority", "encoder.cached_only", "kv.paged_blocks"],
        software_version="epd 0.1.0",
        encoder_cache=service_info_pb2.EncoderCacheInfo(
            key_prefix="epd/enc/v1/" + "5e" * 16, shared_store=True, local_capacity_bytes=256 << 20
        ),
        transcription=service_info_pb2.TranscriptionSpec(
            window_frames=3000, timestamp_begin_token_id=50364, end_of_text_token_id=50256
        ),
        max_running_requests=16,
    )


def vectors() -> list[Message]:
    """One message per RPC request and response type of contract v1.7."""
    return [
        generate_pb2.GenerateRequest(
            request_id="req-1",
            messages=[
                chat_pb2.ChatMessage(role=chat_pb2.CHAT_ROLE_SYSTEM, parts=[chat_pb2.ContentPart(text="Be brief.")]),
                chat_pb2.ChatMessage(
                    role=chat_pb2.CHAT_ROLE_USER,
                    parts=[
                        chat_pb2.ContentPart(media=_image()),
                        chat_pb2.ContentPart(media=_video()),
                        chat_pb2.ContentPart(media=_audio()),
                        chat_pb2.ContentPart(text="What happens in these?"),
                    ],
                ),
            ],
            sampling=_sampling(),
            priority=5,
            cache_salt="tenant-a",  # since 1.8
        ),
        generate_pb2.GenerateResponse(
            request_id="req-1", chunk=_chunk(generation_pb2.FINISH_REASON_STOP), usage=_usage()
        ),
        encoder_pb2.EncodeRequest(
            request_id="req-1",
            items=[
                encoder_pb2.EncodeItem(item_index=0, media=_image()),
                encoder_pb2.EncodeItem(item_index=1, media=_video()),
                encoder_pb2.EncodeItem(item_index=2, media=_audio()),
            ],
            accepted_transports=[tensor_pb2.TRANSPORT_KIND_NIXL, tensor_pb2.TRANSPORT_KIND_INLINE],
            priority=5,
            cache_policy=encoder_pb2.CACHE_POLICY_CACHED_ONLY,
        ),
        encoder_pb2.EncodeResponse(items=[_encoded_image(0), _encoded_video(1), _encoded_audio(2)]),
        prefill_pb2.PrefillRequest(
            request_id="req-1",
            messages=_metadata_only(),
            sampling=_sampling(),
            accepted_kv_transports=[tensor_pb2.TRANSPORT_KIND_NIXL],
            priority=5,
            cache_salt="tenant-a",  # since 1.8
        ),
        prefill_pb2.PrefillResponse(first_chunk=_chunk(), kv_cache=_kv_cache(), decode_state=_decode_state()),
        decode_pb2.DecodeRequest(
            request_id="req-1",
            kv_cache=_paged_kv_cache(),
            decode_state=_engine_decode_state(),
            sampling=_sampling(),
            priority=5,
        ),
        decode_pb2.DecodeResponse(chunk=_chunk(generation_pb2.FINISH_REASON_LENGTH), usage=_usage()),
        prefill_decode_pb2.PrefillDecodeRequest(
            request_id="req-1", messages=_metadata_only(), sampling=_sampling(), priority=-5, cache_salt="tenant-a"
        ),
        prefill_decode_pb2.PrefillDecodeResponse(
            chunk=_chunk(generation_pb2.FINISH_REASON_STOP_SEQUENCE), usage=_usage()
        ),
        lease_pb2.ReleaseLeasesRequest(lease_ids=["lease-0", "lease-1"], reason=lease_pb2.RELEASE_REASON_ABANDONED),
        lease_pb2.ReleaseLeasesResponse(released_count=2),
        service_info_pb2.GetServiceInfoRequest(
            caller_contract_version=service_info_pb2.ContractVersion(major=1, minor=7)
        ),
        service_info_pb2.GetServiceInfoResponse(info=_service_info()),
        stats_pb2.GetStatsRequest(),
        stats_pb2.GetStatsResponse(
            pool=stats_pb2.TransferPoolStats(
                capacity_bytes=1 << 30,
                slots_in_use=3,
                bytes_in_use=3 << 20,
                quarantined_slots=1,
                active_leases=2,
                acked_leases=40,
                released_leases=5,
                expired_leases=1,
            ),
            requests_in_flight=2,
            active_sequences=4,
        ),
    ]
