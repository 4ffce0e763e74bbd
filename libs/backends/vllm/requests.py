"""A metadata-only epd.v1 conversation as a vLLM request, validated before vLLM sees it.

vLLM dies outright on several malformed inputs (an item its encoder cache never gets, a grid that
does not fit the placeholder count, ...), so everything is checked here first, with the reference
runtime's own prompt rules (libs/runtime/prompt.py: modality supported, no placeholder tokens in
text, grid = placeholder count, Qwen3-VL timestamps) and the handles' tensor specs against what
the model consumes. The result:

- the prompt: the checkpoint's chat template with ONE placeholder per item (vLLM expands it from
  the layout metadata), as token ids;
- `multi_modal_data`: the layout metadata only (grids, timestamps, audio feature lengths), no
  embeddings (vLLM's EC consumer path);
- `multi_modal_uuids`: `<mm_hash>-<lease id>` per item, unique per lease, so vLLM never answers a
  request from another request's cache entry and every lease is read (and acked) once;
- per item an `ItemDescriptor`, for the EC connector in vLLM's worker.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from libs.backends.identity import model_type, refusal
from libs.backends.vllm.video_decisions import (
    SECONDS_PER_GRID_FAMILIES,
    vllm_keeps_outer_video_markers,
    without_outer_video_markers,
)
from libs.contract.epd.v1 import chat_pb2, tensor_pb2
from libs.contract.errors import InvalidArgument
from libs.runtime import types as eng
from libs.runtime.checkpoint import Checkpoint
from libs.runtime.families import adapter_for
from libs.runtime.prompt import build_prompt, prompt_ids
from libs.serving import convert
from libs.transfer import ExpectedTensor, TransferConfig


def failure_path(directory: Path, request_id: str) -> Path:
    """Where the worker reports a request whose embeddings could not be read."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in request_id)
    return directory / f"{safe}.json"


def metadata_parts(resolved: Any) -> tuple[bytes, bool]:
    """A transfer resolver's answer (a bare blob, or the blob and whether slots are stamped)."""
    if isinstance(resolved, bytes | bytearray):
        return bytes(resolved), False
    return bytes(resolved.blob), bool(getattr(resolved, "lease_stamps", False))


@dataclass(frozen=True)
class ItemDescriptor:
    """What the EC connector needs to read one item (plain types: it crosses vLLM's msgpack)."""

    request_id: str
    handle: str  # base64 of the serialized epd.v1 TensorHandle
    agent_name: str
    agent_metadata_b64: str  # the producer's NIXL agent metadata (from its ServiceInfo)
    lease_stamps: bool  # the producer stamps its slots: the reader checks the stamps
    rows: int
    width: int  # of the concatenated tensor (embeddings + extras)
    tensors: tuple[tuple[str, int, int], ...]  # (name, wire dtype, width) the handle must carry
    deadline: float  # time.time() after which the read is pointless (0: none)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(raw: dict[str, Any]) -> ItemDescriptor:
        raw = dict(raw)
        raw["tensors"] = tuple(tuple(t) for t in raw["tensors"])
        return ItemDescriptor(**raw)

    @property
    def agent_metadata(self) -> bytes:
        return base64.b64decode(self.agent_metadata_b64)

    def tensor_handle(self) -> tensor_pb2.TensorHandle:
        return tensor_pb2.TensorHandle.FromString(base64.b64decode(self.handle))

    @property
    def nbytes(self) -> int:
        """Bytes the worker reads for this item (every tensor of the handle)."""
        return sum(int(t.spec.nbytes) for t in self.tensor_handle().tensors)

    def expected(self) -> dict[str, ExpectedTensor]:
        return {name: ExpectedTensor(dtype, (self.rows, width)) for name, dtype, width in self.tensors}


@dataclass
class PlannedRequest:
    prompt: dict[str, Any]  # vLLM's prompt dict
    items: dict[str, ItemDescriptor]  # uuid -> descriptor
    prompt_tokens: int  # after placeholder expansion


class RequestPlanner:
    """Turns conversations into vLLM requests for one checkpoint (tokenizer and family rules only;
    no weights are loaded here)."""

    def __init__(self, model: Path, *, dtype: str = "float32", max_model_len: int = 4096) -> None:
        from transformers import AutoTokenizer

        if (why := refusal("vllm", model_type(model))) is not None:
            raise ValueError(why)
        self.checkpoint = Checkpoint(model)
        self.adapter = adapter_for(self.checkpoint)
        self.tokenizer: Any = AutoTokenizer.from_pretrained(str(model))
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.family = str(self.checkpoint.config.get("model_type", ""))
        config = self.checkpoint.config.get("thinker_config", self.checkpoint.config)
        self.merge = int(config.get("vision_config", {}).get("spatial_merge_size", 2))
        # Qwen3-VL video without the template's outer markers (libs/backends/vllm/video_decisions.py).
        self.outer_video_markers: tuple[int, int, int] | None = None
        if self.family == "qwen3_vl" and vllm_keeps_outer_video_markers():
            start, video, end = (
                self._token_id(token)
                for token in ("<|vision_start|>", self.adapter.placeholder_token(eng.Modality.VIDEO), "<|vision_end|>")
            )
            self.outer_video_markers = (start, video, end)

    def _token_id(self, token: str) -> int:
        token_id = self.tokenizer.convert_tokens_to_ids(token)
        assert isinstance(token_id, int), token
        return token_id

    def expected_specs(self) -> list[eng.EmbeddingSpec]:
        width = self.adapter.hidden_size
        return [
            eng.EmbeddingSpec(
                modality,
                width,
                self.dtype,
                tuple(eng.ExtraTensorSpec(n, width, self.dtype) for n in self.adapter.embedding_extra_names(modality)),
            )
            for modality in sorted(self.adapter.modalities, key=lambda m: m.value)
        ]

    def plan(
        self,
        request_id: str,
        messages: Sequence[chat_pb2.ChatMessage],
        sampling: eng.SamplingParams,
        agent_metadata: Callable[[tensor_pb2.NixlAgentRef], Any],
        deadline: float | None,
    ) -> PlannedRequest:
        """Validate and build; `agent_metadata` resolves (and first-contact checks) a producer."""
        parts = convert.media_parts(messages)
        layouts = [convert.item_layout_to_engine(p.encoded.layout) for p in parts]
        items = [eng.EncodedItem(layout, {}) for layout in layouts]
        engine_messages = convert.messages_to_engine(messages, items)
        with convert.engine_errors():
            expanded = build_prompt(self.tokenizer, self.adapter, engine_messages)  # the reference's rules
        budget = len(expanded.input_ids) + (sampling.max_tokens or 0)
        if budget > self.max_model_len:
            raise InvalidArgument(
                "sampling.max_tokens",
                f"prompt ({len(expanded.input_ids)} tokens) + max_tokens exceeds the model length {self.max_model_len}",
            )
        conversation = [
            {
                "role": message.role.value,
                "content": [
                    {"type": "text", "text": part.text}
                    if isinstance(part, eng.TextPart)
                    else {"type": self.adapter.content_type(part.item.layout.modality)}
                    for part in message.parts
                ],
            }
            for message in engine_messages
        ]
        ids = prompt_ids(self.tokenizer, engine_messages, conversation)
        if self.outer_video_markers is not None:  # (text never holds them: build_prompt refuses it)
            start, video, end = self.outer_video_markers
            ids = without_outer_video_markers(ids, start=start, video=video, end=end)
        specs = {spec.modality: spec for spec in self.expected_specs()}
        descriptors: dict[str, ItemDescriptor] = {}
        uuids: dict[str, list[str]] = {}
        data: dict[str, dict[str, list[Any]]] = {}
        wall_deadline = 0.0 if deadline is None else time.time() + (deadline - time.monotonic())
        for index, (part, layout) in enumerate(zip(parts, layouts, strict=True)):
            handle = part.encoded.embeddings
            field = f"items[{index}].embeddings"
            spec = specs[layout.modality]
            _check_count(layout, self.merge, f"items[{index}].layout")
            wanted = _check_handle(handle, spec, layout.placeholder_token_count, field)
            uuid = f"{layout.mm_hash}-{handle.lease_id}"
            kind = layout.modality.value
            uuids.setdefault(kind, []).append(uuid)
            _add_metadata(data.setdefault(kind, {}), layout, self.family)
            blob, stamps = metadata_parts(agent_metadata(handle.agent))
            descriptors[uuid] = ItemDescriptor(
                request_id=request_id,
                handle=base64.b64encode(handle.SerializeToString()).decode(),
                agent_name=handle.agent.agent_name,
                agent_metadata_b64=base64.b64encode(blob).decode(),
                lease_stamps=stamps,
                rows=layout.placeholder_token_count,
                width=sum(width for _, _, width in wanted),
                tensors=wanted,
                deadline=wall_deadline,
            )
        prompt: dict[str, Any] = {"prompt_token_ids": ids}
        if descriptors:
            prompt["multi_modal_data"] = {kind: _tensors(fields) for kind, fields in data.items()}
            prompt["multi_modal_uuids"] = uuids
        return PlannedRequest(prompt, descriptors, len(expanded.input_ids))

    def plan_decode(self, token_ids: Sequence[int], layouts: Sequence[eng.ItemLayout], field: str) -> dict[str, Any]:
        """The prompt a decode engine rebuilds the sequence from, as prefill's engine took it: token
        ids with one placeholder per item and the items' layout metadata, no embeddings (its KV
        arrives from prefill). Checked first: an inconsistent item would kill the engine."""
        to_id = self.tokenizer.convert_tokens_to_ids
        placeholders = {to_id(self.adapter.placeholder_token(m)): m for m in self.adapter.modalities}
        in_prompt = [placeholders[t].value for t in token_ids if t in placeholders]
        items = [layout.modality.value for layout in layouts]
        if in_prompt != items:
            raise InvalidArgument(f"{field}.token_ids", f"placeholders {in_prompt} do not match the items {items}")
        data: dict[str, dict[str, list[Any]]] = {}
        uuids: dict[str, list[str]] = {}
        for index, layout in enumerate(layouts):
            if layout.modality not in self.adapter.modalities:
                raise InvalidArgument(f"{field}.items[{index}].modality", f"no {layout.modality.value} input")
            _check_count(layout, self.merge, f"{field}.items[{index}]")
            _add_metadata(data.setdefault(layout.modality.value, {}), layout, self.family)
            # Content hashes: equal items may share decode's prefix cache, as their KV is equal.
            uuids.setdefault(layout.modality.value, []).append(layout.mm_hash)
        prompt: dict[str, Any] = {"prompt_token_ids": list(token_ids)}
        if layouts:
            prompt["multi_modal_data"] = {kind: _tensors(fields) for kind, fields in data.items()}
            prompt["multi_modal_uuids"] = uuids
        return prompt

    def kv_dims(self) -> tuple[int, int, int]:
        """(layers, KV heads, head size) of the language model: the KV layout a handoff describes."""
        text = self.adapter.text_config
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        return int(text.num_hidden_layers), int(text.num_key_value_heads), int(head_dim)


def _check_count(layout: eng.ItemLayout, merge: int, field: str) -> None:
    """vLLM sizes an item's placeholder range from its metadata and places the embedding rows there:
    rows that do not fill it exactly crash its model runner, so the layout must be consistent."""
    from libs.runtime.families.qwen2_5_omni import audio_output_length  # vLLM's audio rule too

    count = layout.placeholder_token_count
    grid = layout.image or layout.video
    if grid is not None:
        t, h, w = grid.grid_t, grid.grid_h, grid.grid_w
        if min(t, h, w) < 1 or h % merge or w % merge or t * h * w != count * merge * merge:
            raise InvalidArgument(
                f"{field}.placeholder_token_count",
                f"grid {t}x{h}x{w} (merge {merge}) does not give placeholder_token_count {count}",
            )
    elif layout.audio is not None and audio_output_length(layout.audio.feature_length) != count:
        raise InvalidArgument(
            f"{field}.placeholder_token_count",
            f"audio feature_length {layout.audio.feature_length} does not give placeholder_token_count {count}",
        )


def _check_handle(
    handle: tensor_pb2.TensorHandle, spec: eng.EmbeddingSpec, rows: int, field: str
) -> tuple[tuple[str, int, int], ...]:
    """The handle must carry exactly what the model consumes, over NIXL (vLLM's worker reads it)."""
    if handle.transport != tensor_pb2.TRANSPORT_KIND_NIXL:
        raise InvalidArgument(f"{field}.transport", "the vLLM engine reads embeddings over NIXL only")
    wanted = (
        ("embeddings", convert.DTYPE_TO_WIRE[spec.dtype], spec.width),
        *((extra.name, convert.DTYPE_TO_WIRE[extra.dtype], extra.width) for extra in spec.extra_tensors),
    )
    have = {desc.name: desc.spec for desc in handle.tensors}
    if set(have) != {name for name, _, _ in wanted}:
        raise InvalidArgument(f"{field}.tensors", f"tensors {sorted(have)} != {sorted(n for n, _, _ in wanted)}")
    for name, dtype, width in wanted:
        got = have[name]
        if list(got.shape) != [rows, width] or got.dtype != dtype:
            raise InvalidArgument(
                f"{field}.tensors",
                f"{name} is {list(got.shape)} {tensor_pb2.DType.Name(got.dtype)}, "
                f"the model wants [{rows}, {width}] {tensor_pb2.DType.Name(dtype)}",
            )
    return wanted


def _add_metadata(fields: dict[str, list[Any]], layout: eng.ItemLayout, family: str) -> None:
    """The layout metadata vLLM sizes an item's placeholder range from (no embeddings)."""
    if layout.image is not None:
        g = layout.image
        fields.setdefault("image_grid_thw", []).append([g.grid_t, g.grid_h, g.grid_w])
    elif layout.video is not None:
        v = layout.video
        fields.setdefault("video_grid_thw", []).append([v.grid_t, v.grid_h, v.grid_w])
        if family == "qwen3_vl":
            fields.setdefault("timestamps", []).append(list(v.grid_timestamps_s))
        elif family in SECONDS_PER_GRID_FAMILIES:  # M-RoPE's temporal step (video_decisions.py)
            fields.setdefault("second_per_grid_ts", []).append(v.seconds_per_grid)
    elif layout.audio is not None:
        fields.setdefault("audio_feature_lengths", []).append(layout.audio.feature_length)


def _tensors(fields: dict[str, list[Any]]) -> dict[str, Any]:
    return {name: values if name == "timestamps" else torch.tensor(values) for name, values in fields.items()}


# Registered pool of vLLM's worker's NIXL agent when the service gives none (`pool_mib`): embeddings
# of one step's loads land here before they are copied into vLLM's encoder cache, on the device.
_WORKER_POOL_MIB = 64


def worker_transfer_config(extra: dict[str, Any]) -> TransferConfig:
    """The worker's NIXL agent from the service's transport settings (`ec_connector_extra_config`,
    libs/backends/vllm/runtime.py `engine_args`), as libs/serving/transport.py makes the services'."""
    checksum = bool(extra.get("checksum", True))
    tls = str(extra.get("ucx_tls", ""))
    return TransferConfig(
        agent_name_prefix="vllm-ec",
        pool_bytes=int(extra.get("pool_mib", _WORKER_POOL_MIB)) << 20,
        verify_checksum=checksum,
        ucx_net_devices=str(extra.get("ucx_net_devices", "lo")),
        extra_env=(("UCX_TLS", tls),) if tls else (),
    )
