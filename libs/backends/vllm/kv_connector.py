"""The project's KV connector: vLLM's NixlConnector (pull mode: decode's worker READs prefill's paged
KV blocks over NIXL, CPU memory on both sides), with what a small shared CPU host and the services
need. Loaded by vLLM itself (`kv_connector_module_path="libs.backends.vllm.kv_connector"`), once in
EngineCore (scheduler role) and once in the Worker (worker role).

What it changes, worker side (`kv_connector_extra_config` keys, defaults in `DEFAULTS`), around
vLLM's worker constructor only (both are listed with the project's other vLLM patches in
patches.py, `SCOPED`, and checked against the same vLLM version):

- `epd_keep_affinity`: vLLM's NIXL worker pins the calling thread (the model runner, and every
  thread it starts afterwards: NIXL's and UCX's) to the last core of each NUMA node, to keep
  transfers off the forward's cores. On a host with few cores that puts the forward on the core
  the other engines' transfer threads use too. The connector restores the worker's own CPU set on
  every thread the constructor pinned.
- `epd_progress_wakeup_s`: vLLM's NIXL agent runs NIXL's progress thread with a zero poll
  timeout, which spins a core for as long as the agent lives (one per engine). With a timeout the
  thread sleeps on UCX's event fds and wakes on traffic (as `libs.transfer` runs its agents).
  None keeps vLLM's spinning thread.
- leases: a KV handoff nobody will read (the request was cancelled, or finished at its first
  token) is released by the service through `EpdKvWorkerExtension.epd_release_kv`: its blocks are
  freed at the next step instead of at vLLM's lease expiry. `epd_kv_status` counts held,
  read (acked by decode), released and expired handoffs for the service's stats.

`EpdKvWorkerExtension` is mixed into vLLM's worker (`worker_extension_cls`), so the service reaches
it with `AsyncLLM.collective_rpc("epd_release_kv", args=(ids,))`; vLLM runs those calls on the
worker's own thread between steps, so no locking is needed here.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
    from vllm.v1.kv_cache_interface import KVCacheConfig

DEFAULTS: dict[str, Any] = {"epd_keep_affinity": True, "epd_progress_wakeup_s": 0.01}
# A release that arrives before the worker learned of the handoff waits this long for it, seconds.
_PENDING_RELEASE_S = 30.0


class EpdNixlConnector(NixlPullConnector):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        assert vllm_config.kv_transfer_config is not None
        extra = {**DEFAULTS, **vllm_config.kv_transfer_config.kv_connector_extra_config}
        if role != KVConnectorRole.WORKER:
            super().__init__(vllm_config, role, kv_cache_config)
            return
        # Around vLLM's worker constructor only (patches.SCOPED: why not process-wide).
        cpus = os.sched_getaffinity(0)
        with _progress_thread_wakeup(extra["epd_progress_wakeup_s"]):
            super().__init__(vllm_config, role, kv_cache_config)
        if extra["epd_keep_affinity"]:
            _restore_affinity(cpus)
        self._pending_release: dict[str, float] = {}  # engine request id -> when asked
        self._released: set[str] = set()  # expired on purpose, awaiting vLLM's reap
        self.counts = {"acked": 0, "released": 0, "expired": 0}

    # ---- leases (worker side) --------------------------------------------------------------------

    def release(self, request_ids: list[str]) -> None:
        now = time.monotonic()
        for request_id in request_ids:
            self._pending_release[request_id] = now
        self._apply_releases()

    def _apply_releases(self) -> None:
        worker = self.connector_worker
        assert worker is not None
        held = worker._reqs_to_send  # engine request id -> expiry (vLLM's perf_counter)
        now = time.monotonic()
        for request_id, asked in list(self._pending_release.items()):
            if request_id in held:
                held[request_id] = 0.0  # vLLM's own expiry path frees the blocks at this step
                self._released.add(request_id)
                del self._pending_release[request_id]
            elif now - asked > _PENDING_RELEASE_S:
                del self._pending_release[request_id]  # read, expired or never ours

    def status(self) -> dict[str, Any]:
        worker = self.connector_worker
        assert worker is not None
        return {"held_ids": sorted(worker._reqs_to_send), **self.counts}

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        worker = self.connector_worker
        assert worker is not None
        self._apply_releases()
        now = time.perf_counter()
        expiring = {rid for rid, expiry in worker._reqs_to_send.items() if expiry <= now}
        results = super().get_transfer_results(finished_req_ids)
        for request_id in results.finished_sending:
            if request_id in self._released:
                self._released.discard(request_id)
                self.counts["released"] += 1
            elif request_id in expiring:
                self.counts["expired"] += 1
            else:
                self.counts["acked"] += 1
        return results


class EpdKvWorkerExtension:
    """Methods the service calls on vLLM's worker (`collective_rpc`)."""

    def epd_release_kv(self, request_ids: list[str]) -> None:
        _connector().release(list(request_ids))

    def epd_kv_status(self) -> dict[str, Any]:
        return _connector().status()


def _connector() -> EpdNixlConnector:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector = get_kv_transfer_group()
    if not isinstance(connector, EpdNixlConnector):
        raise RuntimeError(f"the worker's KV connector is {type(connector).__name__}, not EpdNixlConnector")
    return connector


@contextlib.contextmanager
def _progress_thread_wakeup(wakeup_s: float | None) -> Iterator[None]:
    """NIXL agents created inside get a progress thread that sleeps between UCX events (the Python
    API hard-codes its poll timeout to 0: a spinning thread)."""
    if wakeup_s is None:
        yield
        return
    from libs.transfer.nixl_package import nixl_module

    api = nixl_module("_api")  # the build vLLM's `nixl._api` is (libs/transfer's rule)
    real = api.nixlBind.nixlAgent

    def with_wakeup(name: str, config: Any) -> Any:
        config.pthrDelay = int(wakeup_s * 1e6)
        return real(name, config)

    api.nixlBind.nixlAgent = with_wakeup
    try:
        yield
    finally:
        api.nixlBind.nixlAgent = real


def _restore_affinity(cpus: set[int]) -> None:
    """Give the threads vLLM's constructor pinned (this one and those it started: they inherit the
    pin) their CPU set back; threads bound elsewhere (OpenMP's) keep their binding."""
    pinned = os.sched_getaffinity(0)
    if pinned == cpus:
        return
    for task in Path("/proc/self/task").iterdir():
        tid = int(task.name)
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            if os.sched_getaffinity(tid) == pinned:
                os.sched_setaffinity(tid, cpus)
