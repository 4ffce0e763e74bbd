"""The project's EC (encoder-cache) connector: vLLM's encoder cache filled with embeddings the
project's encoder services hold, read over NIXL inside vLLM's worker process, so vLLM never runs
its own vision/audio tower and the bytes move once (encoder pool -> worker).

Loaded by vLLM itself (`ec_connector_module_path="libs.backends.vllm.ec_connector"`), once in
EngineCore (scheduler role) and once in the Worker (worker role). A request lists its items in
`SamplingParams.extra_args["ec_transfer_params"]["epd_items"]`: {item uuid -> descriptor} (see
`libs.backends.vllm.requests.ItemDescriptor`), the uuid being the request's
`multi_modal_uuids` entry, unique per lease so every lease is read (and acked) exactly once.

A READ that fails (lease expired or released, encoder gone, checksum or shape wrong) must not
reach vLLM's model runner: a missing encoder-cache entry kills the engine. The worker then puts
zeros of the expected shape in the cache, writes the typed failure to `failure_dir` for the
service (which aborts the request before streaming anything), and reports the item so the
scheduler fails the request too (`take_unavailable_requests`).
"""

from __future__ import annotations

import json
import os
import time
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

from libs.backends.vllm import engine_polling, seeded_sampling
from libs.backends.vllm.requests import ItemDescriptor, failure_path, worker_transfer_config

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

    from libs.transfer import ReceivedTensors, TensorConsumer


def engine_device(vllm_config: Any) -> torch.device:
    """Where the engine's tensors live (vLLM's platform device: cpu, cuda, ...)."""
    device = getattr(getattr(vllm_config, "device_config", None), "device", None)
    return device if isinstance(device, torch.device) else torch.device(str(device or "cpu"))


@dataclass
class LoadMetadata(ECConnectorMetadata):
    """Scheduler -> worker, per step: the items to read."""

    loads: dict[str, dict[str, Any]] = field(default_factory=dict)  # uuid -> descriptor


@dataclass
class LoadFailures(ECConnectorWorkerMetadata):
    """Worker -> scheduler, per step: requests whose items could not be read."""

    request_ids: set[str] = field(default_factory=set)

    def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata:
        assert isinstance(other, LoadFailures)
        return LoadFailures(self.request_ids | other.request_ids)


def concatenated(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """vLLM's encoder-cache layout: Qwen3-VL keeps the deepstack features next to the embeddings
    on the last dimension (embeddings, deepstack.0, deepstack.1, ...)."""
    extras = sorted((name for name in tensors if name.startswith("deepstack.")), key=lambda n: int(n.split(".")[1]))
    embeddings = tensors["embeddings"]
    return torch.cat([embeddings, *(tensors[name] for name in extras)], dim=-1) if extras else embeddings


def _resolved(item: ItemDescriptor) -> Any:
    """What the service's resolver said of the item's producer, for this process's consumer."""
    import libs.transfer as transfer

    with_stamps = getattr(transfer, "AgentMetadata", None)
    if item.lease_stamps and with_stamps is not None:
        return with_stamps(item.agent_metadata, lease_stamps=True)
    return item.agent_metadata


class EpdECConnector(ECConnectorBase):
    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        extra = vllm_config.ec_transfer_config.ec_connector_extra_config if vllm_config.ec_transfer_config else {}
        self._extra = dict(extra)
        self._failure_dir = Path(str(extra.get("failure_dir", "")))
        self._device = engine_device(vllm_config)
        dtype = vllm_config.model_config.dtype  # resolved to a torch.dtype once the config is built
        self._dtype = dtype if isinstance(dtype, torch.dtype) else torch.float32
        # scheduler side
        self._known: dict[str, dict[str, Any]] = {}  # uuid -> descriptor, while its request lives
        self._pending: dict[str, dict[str, Any]] = {}  # loads for the next worker step
        self._unavailable: set[str] = set()
        # worker side
        self._consumer: TensorConsumer | None = None
        self._failed: set[str] = set()
        engine_polling.install()
        if role == ECConnectorRole.WORKER:
            seeded_sampling.install()

    # ---- scheduler side (EngineCore) -------------------------------------------------------------

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        items = (request.ec_transfer_params or {}).get("epd_items") or {}
        self._known.update(items)
        return True  # the READ happens in the worker at the step that needs the item

    def has_cache_item(self, identifier: str) -> bool:
        return identifier in self._known

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        uuid = request.mm_features[index].identifier
        if uuid in self._known:
            self._pending[uuid] = self._known[uuid]

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
            self._known.pop(feature.identifier, None)
            self._pending.pop(feature.identifier, None)
        return False, None

    # ---- worker side -----------------------------------------------------------------------------

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, LoadMetadata)
        by_request: dict[str, dict[str, ItemDescriptor]] = {}
        for uuid, raw in meta.loads.items():
            if uuid not in encoder_cache:
                item = ItemDescriptor.from_dict(raw)
                by_request.setdefault(item.request_id, {})[uuid] = item
        for request_id, items in by_request.items():
            self._load(request_id, items, encoder_cache)

    def _load(self, request_id: str, items: dict[str, ItemDescriptor], cache: dict[str, torch.Tensor]) -> None:
        from libs.transfer import TransferError

        try:
            received = self._fetch(list(items.values()))
        except TransferError as exc:
            self._fail(request_id, items, cache, exc.grpc_code.name, exc.message)
            return
        except Exception as exc:  # never let a load take the engine down
            self._fail(request_id, items, cache, "UNAVAILABLE", f"embedding read failed: {exc}")
            return
        try:
            for uuid, got in zip(items, received, strict=True):
                # Our own copy, on the engine's device: the pool slot goes back right after.
                cache[uuid] = concatenated(dict(got.tensors)).to(device=self._device, dtype=self._dtype, copy=True)
        finally:
            for got in received:
                got.release()

    def _fetch(self, items: list[ItemDescriptor]) -> list[ReceivedTensors]:
        consumer = self._consumer_for(items)
        deadline = min(item.deadline for item in items)
        timeout = None if deadline <= 0 else max(0.001, deadline - time.time())
        handles = [item.tensor_handle() for item in items]
        expected = [item.expected() for item in items]
        return consumer.fetch_many(handles, expected=expected, timeout_s=timeout)

    def _consumer_for(self, items: list[ItemDescriptor]) -> TensorConsumer:
        if self._consumer is None:
            from libs.transfer import TensorConsumer, TransferAgent

            agent = TransferAgent(worker_transfer_config(self._extra))
            self._metadata: dict[str, Any] = {}
            self._consumer = TensorConsumer(agent, lambda ref: self._metadata[ref.agent_name])
        for item in items:
            self._metadata[item.agent_name] = _resolved(item)
        return self._consumer

    def _fail(
        self, request_id: str, items: dict[str, ItemDescriptor], cache: dict[str, torch.Tensor], code: str, msg: str
    ) -> None:
        for uuid, item in items.items():
            # Zeros keep the model runner alive for this step; the request never streams them.
            cache[uuid] = torch.zeros(item.rows, item.width, dtype=self._dtype, device=self._device)
        self._failed.add(request_id)
        if str(self._failure_dir):
            target = failure_path(self._failure_dir, request_id)
            tmp = target.with_suffix(".tmp")
            tmp.write_text(json.dumps({"code": code, "message": msg}))
            os.replace(tmp, target)

    def build_connector_worker_meta(self) -> ECConnectorWorkerMetadata | None:
        if not self._failed:
            return None
        failed, self._failed = self._failed, set()
        return LoadFailures(failed)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        return  # consumer only: the project's encoder services produce the embeddings

    def shutdown(self) -> None:
        if self._consumer is not None:
            self._consumer.agent.close()
