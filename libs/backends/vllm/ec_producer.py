"""The project's EC (encoder-cache) **producer** connector: vLLM runs the vision tower encoder-only
(`mm_encoder_only`, its own scheduler batching concurrent Encode calls), and its worker writes
each item's output straight into a slot of the encoder service's registered NIXL pool, where
prefill READs it. The bytes are written once (worker -> pool) and never copied again.

Who does what:

- **encoder service** (libs/backends/vllm/encoder.py, its own process): computes each item's
  layout with the project's preprocessing, allocates the item's slot in its *shared* pool
  (libs/transfer/pool.py: a memfd the worker maps), zeroes the slot's stamp, and submits the
  request with one `SlotDescriptor` per item, in item order, in
  `SamplingParams.extra_args["ec_transfer_params"]["epd_slots"]` (each item's `multi_modal_uuids`
  entry is unique per request, so vLLM never answers an item from another request's cache and
  `save_caches` runs for every item). Once vLLM finished
  the request, it checks each slot's `written` mark (or the failure report), then publishes the
  slot (lease stamp, checksums, lease: the usual `Reservation.publish`).
- **EngineCore** (scheduler role, this class): `ensure_cache_available` records the request's
  slots under its items' identifiers (vLLM's `mm_hash`: the uuid, or vLLM's own hash when the
  request carries processor kwargs); `has_cache_item` is always False (an encoder computes);
  `build_connector_meta` hands the slots of the requests scheduled this step to the worker;
  `request_finished` forgets them.
- **Worker** (worker role, this class): `save_caches(encoder_cache, mm_hash)` is called by vLLM's
  model runner right after the tower produced `mm_hash`'s output. It checks rows and width
  against the slot (the project's layout) and writes the tensors (Qwen3-VL: the embeddings and
  each deepstack feature, split from vLLM's concatenated output) into the slot, then the
  `written` mark in the slot's stamp area. Any failure (shape, dtype, an unmappable pool) is
  reported in `failure_dir/<key>.json` ({code, message}) and never raised: the engine lives.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)

from libs.backends.vllm.shared_pool import PoolMaps, SlotDescriptor

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

# What the worker writes over the slot's stamp area once the tensors are in (the service checks it
# before publishing, which overwrites it with the lease stamp).
_WRITTEN = b"EPDWROTE"


def written_mark(key: str) -> bytes:
    """The bytes the worker leaves at the start of a slot it filled for item `key`."""
    return _WRITTEN + hashlib.sha256(key.encode()).digest()


def failure_file(directory: Path, key: str) -> Path:
    """Where the worker reports why item `key` could not be written."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in key)
    return directory / f"{safe}.json"


@dataclass
class SlotMetadata(ECConnectorMetadata):
    """Scheduler -> worker, per step: the slots of the items that may be encoded in it."""

    slots: dict[str, dict[str, Any]] = field(default_factory=dict)  # mm_hash -> SlotDescriptor dict


class ItemRefused(Exception):
    """An item's output does not fit its slot: `code` is the gRPC status name the caller gets."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def write_item(buffer: Any, slot: SlotDescriptor, output: torch.Tensor) -> None:
    """Write `output` ([rows, width] as vLLM's tower gave it) into `slot` of the mapped pool."""
    where = f"items[{slot.item}]"
    if output.dim() != 2 or int(output.shape[0]) != slot.rows or int(output.shape[1]) != slot.width:
        raise ItemRefused(
            "FAILED_PRECONDITION",
            f"{where}: vLLM's tower gave {list(output.shape)}, the project's layout says "
            f"[{slot.rows}, {slot.width}] (preprocessing differs between the engines)",
        )
    try:
        views = slot.views(buffer)
    except ValueError as exc:
        raise ItemRefused("INTERNAL", str(exc)) from None
    source = output.detach().to(device="cpu", dtype=views[0].dtype)
    start = 0
    for view in views:
        width = int(view.shape[1])
        view.copy_(source[:, start : start + width])
        start += width
    mark = written_mark(slot.key)
    buffer[slot.slot_offset : slot.slot_offset + len(mark)] = mark


class EpdECProducer(ECConnectorBase):
    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        config = vllm_config.ec_transfer_config
        extra = dict(config.ec_connector_extra_config) if config is not None else {}
        self._failure_dir = Path(str(extra.get("failure_dir", "")))
        # scheduler side: request id -> {uuid -> descriptor dict}, while the request lives
        self._slots: dict[str, dict[str, dict[str, Any]]] = {}
        self._maps = PoolMaps()  # worker side: the services' pools

    # ---- scheduler side (EngineCore) -------------------------------------------------------------

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        # By position: vLLM keys an item by its uuid, or by a hash of its own when the request
        # carries processor kwargs (a video's), so the identifier is read from the request.
        slots = (request.ec_transfer_params or {}).get("epd_slots") or []
        if slots and request.request_id not in self._slots:
            features = request.mm_features
            self._slots[request.request_id] = {f.identifier: s for f, s in zip(features, slots, strict=False)}
        return True

    def has_cache_item(self, identifier: str) -> bool:
        return False  # an encoder computes every item (uuids are unique per request)

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        meta = SlotMetadata()
        for request_id in scheduler_output.scheduled_encoder_inputs:
            meta.slots.update(self._slots.get(request_id, {}))
        return meta

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        self._slots.pop(request.request_id, None)
        return False, None

    # ---- worker side -----------------------------------------------------------------------------

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        return None  # producer only

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        try:
            meta = self._get_connector_metadata()
            raw = meta.slots.get(mm_hash) if isinstance(meta, SlotMetadata) else None
            if raw is None:
                return  # not an item of the service's (it waits for its mark, and finds none: INTERNAL)
            slot = SlotDescriptor.from_dict(raw)
        except Exception:  # never let a save take the engine down
            return
        try:
            write_item(self._maps.get(slot.pool_path), slot, encoder_cache[mm_hash])
        except ItemRefused as exc:
            self._report(slot.key, exc.code, exc.message)
        except Exception as exc:
            self._report(slot.key, "INTERNAL", f"items[{slot.item}]: writing vLLM's output failed: {exc}")

    def _report(self, uuid: str, code: str, message: str) -> None:
        if not str(self._failure_dir):
            return
        with contextlib.suppress(OSError):
            target = failure_file(self._failure_dir, uuid)
            tmp = target.with_suffix(".tmp")
            tmp.write_text(json.dumps({"code": code, "message": message}))
            os.replace(tmp, target)

    def shutdown(self) -> None:
        self._maps.close()
