"""A metadata-only epd.v1 conversation as a vLLM request, validated before vLLM sees it.

vLLM dies outright on several malformed inputs (an item its encoder cache never gets, a grid that
does not fit the placeholder count, ...), so everything is checked here first, with the reference
runtime's own prompt rules (libs/model/prompt.py: modality supported, no placeholder tokens in
text, grid = placeholder count, Qwen3-VL timestamps) and the handles' tensor specs against what
the model consumes. The result:

- the prompt: the checkpoint's chat template with ONE placeholder per item (vLLM expands it from
  the layout metadata), as token ids;
- `multi_modal_data`: the layout metadata only (grids, timestamps, audio feature lengths), no
  embeddings (vLLM's EC consumer path);
- `multi_modal_uuids`: each item's content hash within the request's tenant
  (`libs.model.content.scoped`: mm_hash and `cache_salt`), so equal media share vLLM's encoder
  cache and prefix-cache blocks inside a tenant and never across tenants (a conversation's next
  turn reuses its image's KV); the service reads each lease once, into its shared pool, and tells
  the EC connector where each uuid's tensors lie (`shared_pool.SlotDescriptor`). Speech items keep
  `<mm_hash>-<lease id>`: vLLM caches no encoder-decoder prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from libs.backends.vllm.video_decisions import (
    SECONDS_PER_GRID_FAMILIES,
    vllm_keeps_outer_video_markers,
    without_outer_video_markers,
)
from libs.contract.epd.v1 import chat_pb2, tensor_pb2
from libs.contract.errors import InvalidArgument
from libs.model import content
from libs.model import types as eng
from libs.model.checkpoint import Checkpoint
from libs.model.errors import EmbeddingMismatchError
from libs.model.families import adapter_for
from libs.model.prompt import build_prompt, prompt_ids, speech_item
from libs.serving import convert


def failure_path(directory: Path, request_id: str) -> Path:
    """Where the worker reports a request whose embeddings could not be read."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in request_id)
    return directory / f"{safe}.json"


@dataclass
class PlannedRequest:
    prompt: dict[str, Any]  # vLLM's prompt dict (encoder-decoder: the decoder's, see `with_encoder_states`)
    uuids: list[str]  # each item's `multi_modal_uuids` entry, in the request's item order
    prompt_tokens: int  # after placeholder expansion
    speech: bool = False  # encoder-decoder (Whisper): the item's encoder states go into the request
    max_tokens: int = 0  # the cap of a request that gives none (0: the service's default)


def with_encoder_states(planned: PlannedRequest, states: torch.Tensor) -> dict[str, Any]:
    """An encoder-decoder request as vLLM takes it: the window's encoder states as the audio item
    (the project's Whisper model takes them as they are, whisper_model.py), the decoder prompt.
    The encoder prompt is a placeholder vLLM expands to the states' rows."""
    encoder = {
        "prompt_token_ids": [0],
        "multi_modal_data": {"audio": [states]},
        "multi_modal_uuids": {"audio": planned.uuids},  # (vLLM would hash the states otherwise)
    }
    return {"encoder_prompt": encoder, "decoder_prompt": planned.prompt}


class RequestPlanner:
    """Turns conversations into vLLM requests for one checkpoint (tokenizer and family rules only;
    no weights are loaded here)."""

    def __init__(self, model: Path, *, dtype: str = "float32", max_model_len: int = 4096) -> None:
        from transformers import AutoTokenizer

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
        cache_salt: str = "",
    ) -> PlannedRequest:
        """Validate and build (nothing is read: the service reads the items it is given)."""
        parts = convert.media_parts(messages)
        layouts = [convert.item_layout_to_engine(p.encoded.layout) for p in parts]
        items = [eng.EncodedItem(layout, {}) for layout in layouts]
        engine_messages = convert.messages_to_engine(messages, items)
        if self.adapter.is_encoder_decoder:
            return self._plan_speech(parts, engine_messages, sampling)
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
        ordered: list[str] = []
        uuids: dict[str, list[str]] = {}
        data: dict[str, dict[str, list[Any]]] = {}
        for index, (part, layout) in enumerate(zip(parts, layouts, strict=True)):
            _check_count(layout, self.merge, f"items[{index}].layout")
            if not part.encoded.prefix_held:  # (held: nothing to read; the EC connector checks the hit)
                spec = specs[layout.modality]
                _check_handle(
                    part.encoded.embeddings, spec, layout.placeholder_token_count, f"items[{index}].embeddings"
                )
            uuid = content.scoped(layout.mm_hash, cache_salt)
            kind = layout.modality.value
            uuids.setdefault(kind, []).append(uuid)
            ordered.append(uuid)
            _add_metadata(data.setdefault(kind, {}), layout, self.family)
        prompt: dict[str, Any] = {"prompt_token_ids": ids}
        if ordered:
            prompt["multi_modal_data"] = {kind: _tensors(fields) for kind, fields in data.items()}
            prompt["multi_modal_uuids"] = uuids
        return PlannedRequest(prompt, ordered, len(expanded.input_ids))

    def _plan_speech(
        self,
        parts: Sequence[chat_pb2.ContentPart],
        messages: list[eng.ChatMessage],
        sampling: eng.SamplingParams,
    ) -> PlannedRequest:
        """Whisper, checked as the reference runtime checks it (libs/runtime/encoder_decoder.py):
        one item of encoder states, no text; the decoder prompt generate() starts from."""
        rows = self.adapter.cross_attention_tokens
        with convert.engine_errors():
            field, item = speech_item(self.family, messages)
            if item.layout.cross_attention_rows != rows:
                raise EmbeddingMismatchError(
                    f"layout has {item.layout.cross_attention_rows} cross-attention rows; this model takes "
                    f"{rows} rows of encoder states",
                    field=f"{field}.encoded.layout",
                )
            ids = self.adapter.decoder_prompt(sampling)
        (spec,) = self.expected_specs()
        (part,) = parts
        _check_handle(part.encoded.embeddings, spec, rows, f"{field}.encoded.embeddings")
        room = min(self.adapter.max_positions or self.max_model_len, self.max_model_len) - len(ids)
        if sampling.max_tokens > room:
            raise InvalidArgument(
                "sampling.max_tokens",
                f"max_tokens {sampling.max_tokens} exceeds the {room} positions left after a {len(ids)}-token prompt",
            )
        uuid = f"{item.layout.mm_hash}-{part.encoded.embeddings.lease_id}"
        return PlannedRequest({"prompt_token_ids": ids}, [uuid], len(ids), speech=True, max_tokens=room)

    def plan_decode(
        self, token_ids: Sequence[int], layouts: Sequence[eng.ItemLayout], field: str, cache_salt: str = ""
    ) -> dict[str, Any]:
        """The prompt a decode engine rebuilds the sequence from, as prefill's engine took it: token
        ids with one placeholder per item and the items' layout metadata, no embeddings (its KV
        arrives from prefill), in the request's tenant (`cache_salt`, contract 1.9) as prefill had it.
        Checked first: an inconsistent item would kill the engine."""
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
            # Content hashes in the tenant: equal items may share decode's prefix cache, as their KV
            # is equal, within one tenant only.
            uuids.setdefault(layout.modality.value, []).append(content.scoped(layout.mm_hash, cache_salt))
        prompt: dict[str, Any] = {"prompt_token_ids": list(token_ids)}
        if cache_salt:
            prompt["cache_salt"] = cache_salt
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
    from libs.model.families.qwen2_5_omni import audio_output_length  # vLLM's audio rule too

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


def _check_handle(handle: tensor_pb2.TensorHandle, spec: eng.EmbeddingSpec, rows: int, field: str) -> None:
    """The handle must carry exactly what the model consumes, over NIXL (read into the shared pool
    vLLM's worker copies from)."""
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
