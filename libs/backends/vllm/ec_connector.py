"""The project's EC (encoder-cache) connector: vLLM's encoder cache filled with embeddings the
project's encoder services hold, so vLLM never runs its own vision/audio tower.

Who does what:

- **PD / prefill service** (pd.py, prefill.py, its own process): READs every item of a request
  over NIXL into its *shared* pool (libs/transfer/pool.py: a memfd vLLM's worker maps), under the
  request's deadline, checksums and lease stamps checked, *before* vLLM sees the request: a slow
  or failed read holds or fails that request only, while vLLM's steps go on for every other
  sequence. It submits the request with one `SlotDescriptor` per item
  (`SamplingParams.extra_args["ec_transfer_params"]["epd_items"]`: {item uuid -> descriptor}, the
  uuid being the request's `multi_modal_uuids` entry: the item's content hash within its tenant,
  so requests in flight together may name the same uuid, each with a slot of its own) and gives the
  slots back once vLLM is done with the request.
- **EngineCore** (scheduler role, this class, loaded by vLLM through `ec_connector_module_path`):
  records the request's items, answers that they are available (they are: in the service's
  pool), hands the ones allocated in a step to the worker (each from the slot of the request it
  is allocated for, which lives until that request finishes), fails a request the worker reports.
  An item vLLM already holds (its encoder cache, or a prefix-cache hit past it) is never asked for.
  An item the router sent as held (contract 1.9, `prefix_held`: no slot, the service read nothing)
  must lie inside the request's prefix-cache hit: when vLLM's lookup falls short of it, the
  request is never scheduled (its zeros must not reach the model, nor blocks built on them the
  prefix cache) and fails with reason EMBEDDING_NEEDED, so the router encodes it and retries.
- **Worker** (worker role, this class): copies each item from the mapped pool into vLLM's encoder
  cache, on the engine's device, in the engine's dtype (Qwen3-VL: deepstack features next to the
  embeddings). A copy that fails (the pool cannot be mapped, a wrong descriptor) must not reach
  vLLM's model runner, as a missing encoder-cache entry kills the engine: the worker puts zeros of
  the item's shape in the cache, writes the typed failure to `failure_dir` for the service (which
  aborts the request before streaming anything), and reports the request so the scheduler fails
  it too (`take_unavailable_requests`).
"""

from __future__ import annotations

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
    ECConnectorWorkerMetadata,
)

from libs.backends.vllm.requests import failure_path
from libs.backends.vllm.shared_pool import PoolMaps, SlotDescriptor, read_item

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request


def engine_device(vllm_config: Any) -> torch.device:
    """Where the engine's tensors live (vLLM's platform device: cpu, cuda, ...)."""
    device = getattr(getattr(vllm_config, "device_config", None), "device", None)
    return device if isinstance(device, torch.device) else torch.device(str(device or "cpu"))


@dataclass
class LoadMetadata(ECConnectorMetadata):
    """Scheduler -> worker, per step: the items to copy into the encoder cache."""

    loads: dict[str, dict[str, Any]] = field(default_factory=dict)  # uuid -> SlotDescriptor dict


@dataclass
class LoadFailures(ECConnectorWorkerMetadata):
    """Worker -> scheduler, per step: requests whose items could not be copied."""

    request_ids: set[str] = field(default_factory=set)

    def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata:
        assert isinstance(other, LoadFailures)
        return LoadFailures(self.request_ids | other.request_ids)


class EpdECConnector(ECConnectorBase):
    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        extra = vllm_config.ec_transfer_config.ec_connector_extra_config if vllm_config.ec_transfer_config else {}
        self._failure_dir = Path(str(extra.get("failure_dir", "")))
        self._device = engine_device(vllm_config)
        dtype = vllm_config.model_config.dtype  # resolved to a torch.dtype once the config is built
        self._dtype = dtype if isinstance(dtype, torch.dtype) else torch.float32
        # scheduler side
        self._known: dict[str, dict[str, dict[str, Any]]] = {}  # uuid -> {request id -> descriptor}
        self._pending: dict[str, dict[str, Any]] = {}  # loads for the next worker step
        self._unavailable: set[str] = set()
        # worker side
        self._maps = PoolMaps()
        self._failed: set[str] = set()

    # ---- scheduler side (EngineCore) -------------------------------------------------------------

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        # Called once the prefix-cache lookup set `num_computed_tokens`, before anything of the
        # request is scheduled, and again every step it waits or runs.
        items = _items(request)
        for uuid, descriptor in items.items():
            self._known.setdefault(uuid, {})[request.request_id] = descriptor
        for index, feature in enumerate(request.mm_features):
            position = feature.mm_position
            if feature.identifier not in items and position.offset + position.length > num_computed_tokens:
                self._held_miss(request, index, num_computed_tokens)
                return False
        return True  # the service read the others into its pool before it submitted the request

    def _held_miss(self, request: Request, index: int, hit_tokens: int) -> None:
        """A held item past the prefix-cache hit: fail the request at the step's end, unscheduled."""
        self._unavailable.add(request.request_id)
        if str(self._failure_dir):
            report = {
                "code": "FAILED_PRECONDITION",
                "reason": "EMBEDDING_NEEDED",
                "message": f"items[{index}] was sent as held in the prefix cache, which covers {hit_tokens} of the "
                f"prompt's {request.num_prompt_tokens} tokens: send its embeddings",
            }
            _report(failure_path(self._failure_dir, _service_request_id(request)), report)

    def has_cache_item(self, identifier: str) -> bool:
        return identifier in self._known

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        uuid = request.mm_features[index].identifier
        descriptor = self._known.get(uuid, {}).get(request.request_id)
        if descriptor is not None:
            self._pending[uuid] = descriptor

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        meta = LoadMetadata(loads=dict(self._pending))
        self._pending.clear()
        return meta

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        failures = connector_output.ec_connector_worker_meta
        if isinstance(failures, LoadFailures):
            self._unavailable |= failures.request_ids

    def take_unavailable_requests(self) -> set[str]:
        taken, self._unavailable = self._unavailable, set()
        return taken

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        for feature in request.mm_features:
            holders = self._known.get(feature.identifier, {})
            mine = holders.pop(request.request_id, None)
            if not holders:
                self._known.pop(feature.identifier, None)
            if mine is not None and self._pending.get(feature.identifier) is mine:
                self._pending.pop(feature.identifier)  # its slot goes back with the request
        return False, None

    # ---- worker side -----------------------------------------------------------------------------

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, LoadMetadata)
        for uuid, raw in meta.loads.items():
            if uuid not in encoder_cache:
                self._load(uuid, raw, encoder_cache)

    def _load(self, uuid: str, raw: dict[str, Any], cache: dict[str, torch.Tensor]) -> None:
        slot = SlotDescriptor.from_dict(raw)
        try:
            cache[uuid] = read_item(self._maps.get(slot.pool_path), slot, device=self._device, dtype=self._dtype)
        except Exception as exc:  # never let a load take the engine down
            self._fail(slot, uuid, cache, f"items[{slot.item}]: {exc}")

    def _fail(self, slot: SlotDescriptor, uuid: str, cache: dict[str, torch.Tensor], msg: str) -> None:
        # Zeros keep the model runner alive for this step; the request never streams them.
        cache[uuid] = torch.zeros(slot.rows, slot.width, dtype=self._dtype, device=self._device)
        self._failed.add(slot.request_id)
        if str(self._failure_dir):
            report = {"code": "INTERNAL", "message": f"embedding copy into vLLM failed: {msg}"}
            _report(failure_path(self._failure_dir, slot.request_id), report)

    def build_connector_worker_meta(self) -> ECConnectorWorkerMetadata | None:
        if not self._failed:
            return None
        failed, self._failed = self._failed, set()
        return LoadFailures(failed)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        return  # consumer only: the project's encoder services produce the embeddings

    def shutdown(self) -> None:
        self._maps.close()


def _items(request: Request) -> dict[str, dict[str, Any]]:
    """The request's {uuid -> slot descriptor}, as the service submitted them."""
    return dict((request.ec_transfer_params or {}).get("epd_items") or {})


def _service_request_id(request: Request) -> str:
    """The service's id of the request (vLLM's own may carry a suffix)."""
    return str((request.ec_transfer_params or {}).get("epd_request_id") or request.request_id)


def _report(target: Path, report: dict[str, str]) -> None:
    """The typed failure the service raises for the request (`streams.raise_load_failure`)."""
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps(report))
    os.replace(tmp, target)
