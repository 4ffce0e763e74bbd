"""Builders and fakes shared by the cache tests."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from libs.cache.entry import CacheEntry
from libs.cache.keys import CacheKey, Namespace
from libs.cache.store import OBJECT_NOT_FOUND, StoreResult, StoreStatus
from libs.model.content import content_hash
from libs.model.types import (
    AudioLayout,
    EmbeddingSpec,
    ExtraTensorSpec,
    ImageLayout,
    ItemLayout,
    Modality,
    ProcessorOptions,
    VideoLayout,
)

WIDTH = 16


def specs_for(dtype: str) -> dict[Modality, EmbeddingSpec]:
    """The per-modality specs an encoder emitting `dtype` would measure."""
    return {
        Modality.IMAGE: EmbeddingSpec(Modality.IMAGE, WIDTH, dtype),
        Modality.VIDEO: EmbeddingSpec(Modality.VIDEO, WIDTH, dtype, (ExtraTensorSpec("deepstack.0", WIDTH, dtype),)),
        Modality.AUDIO: EmbeddingSpec(Modality.AUDIO, WIDTH, dtype),
    }


NS = Namespace(model_id="tiny-qwen2-vl", revision="r1", weights_digest="sha256:abc", dtype="float32")
SPECS = specs_for("float32")


def layout_for(modality: Modality, mm_hash: str, rows: int) -> ItemLayout:
    if modality is Modality.IMAGE:
        return ItemLayout(modality, 0, mm_hash, rows, image=ImageLayout(1, 2, 2 * rows))
    if modality is Modality.VIDEO:
        video = VideoLayout(2, 2, rows, seconds_per_grid=1.0, grid_timestamps_s=(0.0, 1.0), sampled_frames=4)
        return ItemLayout(modality, 0, mm_hash, rows, video=video)
    return ItemLayout(modality, 0, mm_hash, rows, audio=AudioLayout(rows * 4, rows, 1.5))


def make_entry(
    data: bytes = b"item",
    modality: Modality = Modality.IMAGE,
    *,
    rows: int = 4,
    width: int = WIDTH,
    namespace: Namespace = NS,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[CacheKey, CacheEntry]:
    mm_hash = content_hash(modality, ProcessorOptions(), data)
    gen = torch.Generator().manual_seed(seed)
    tensors = {"embeddings": torch.randn(rows, width, generator=gen).to(dtype)}
    if modality is Modality.VIDEO:
        tensors["deepstack.0"] = torch.randn(rows, width, generator=gen).to(dtype)
    return CacheKey(NS, mm_hash), CacheEntry(namespace, layout_for(modality, mm_hash, rows), tensors)


class FakeStore:
    """In-memory `StoreClient` with Mooncake's put-keeps-old-value rule; `down` makes it unavailable."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.down = False
        self.calls: list[tuple[str, str]] = []
        self.put_gate: threading.Event | None = None  # when set, puts wait for it
        self.remove_gate: threading.Event | None = None  # when set, removals wait for it
        self.lock = threading.Lock()

    def _unavailable(self) -> StoreResult:
        return StoreResult(StoreStatus.UNAVAILABLE, detail="fake store down")

    def connect(self) -> StoreResult:
        return self._unavailable() if self.down else StoreResult(StoreStatus.OK)

    def get(self, key: str) -> StoreResult:
        with self.lock:
            self.calls.append(("get", key))
            if self.down:
                return self._unavailable()
            blob = self.data.get(key)
        if blob is None:
            return StoreResult(StoreStatus.NOT_FOUND, code=OBJECT_NOT_FOUND)
        return StoreResult(StoreStatus.OK, data=blob)

    async def aget(self, key: str) -> StoreResult:
        return self.get(key)

    def put(self, key: str, data: bytes) -> StoreResult:
        if self.put_gate is not None:
            self.put_gate.wait(10)
        with self.lock:
            self.calls.append(("put", key))
            if self.down:
                return self._unavailable()
            self.data.setdefault(key, data)
        return StoreResult(StoreStatus.OK)

    def exists(self, key: str) -> StoreResult:
        with self.lock:
            self.calls.append(("exists", key))
            if self.down:
                return self._unavailable()
            return StoreResult(StoreStatus.OK if key in self.data else StoreStatus.NOT_FOUND)

    async def aexists(self, key: str) -> StoreResult:
        return self.exists(key)

    def remove(self, key: str) -> StoreResult:
        if self.remove_gate is not None:
            self.remove_gate.wait(10)
        with self.lock:
            self.calls.append(("remove", key))
            self.data.pop(key, None)
        return StoreResult(StoreStatus.OK)

    def close(self) -> None:
        pass


class FakeMooncake:
    """Stands in for `mooncake.store.MooncakeDistributedStore`: return codes, optional hooks."""

    def __init__(self, setup_code: int = 0) -> None:
        self.objects: dict[str, bytes] = {}
        self.setup_code = setup_code
        self.hook: Callable[[str], Any] | None = None  # called with the method name; may block or raise
        self.calls: list[str] = []

    def _enter(self, name: str) -> None:
        self.calls.append(name)
        if self.hook is not None:
            self.hook(name)

    def setup(self, *args: Any) -> int:
        self._enter("setup")
        return self.setup_code

    def get_size(self, key: str) -> int:
        self._enter("get_size")
        return len(self.objects[key]) if key in self.objects else OBJECT_NOT_FOUND

    def get(self, key: str) -> bytes:
        self._enter("get")
        return self.objects.get(key, b"")

    def put(self, key: str, value: bytes) -> int:
        self._enter("put")
        self.objects.setdefault(key, bytes(value))
        return 0

    def is_exist(self, key: str) -> int:
        self._enter("is_exist")
        return int(key in self.objects)

    def remove(self, key: str, force: bool = False) -> int:
        self._enter("remove")
        return 0 if self.objects.pop(key, None) is not None else OBJECT_NOT_FOUND

    def close(self) -> int:
        return 0


class Metrics:
    """A private meter and a reader of its counters: {(name, label value or ""): total}."""

    def __init__(self) -> None:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader

        self.reader = InMemoryMetricReader()
        self.provider = MeterProvider(metric_readers=[self.reader])
        self.meter = self.provider.get_meter("epd-test")

    def counters(self) -> dict[tuple[str, str], int]:
        out: dict[tuple[str, str], int] = {}
        data = self.reader.get_metrics_data()
        for rm in data.resource_metrics if data else []:
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    for point in metric.data.data_points:
                        label = ",".join(str(v) for v in (point.attributes or {}).values())
                        out[(metric.name, label)] = out.get((metric.name, label), 0) + int(point.value)  # type: ignore[union-attr]
        return out
