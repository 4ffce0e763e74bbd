"""Items in a service's *shared* pool (libs/transfer/pool.py: a memfd vLLM's worker maps), as the
project's EC connectors hand them across vLLM's processes.

- Encoder (`ec_producer.py`): the service allocates a slot per item, vLLM's worker writes the
  tower's output into it (`write_item`).
- PD and prefill (`ec_connector.py`): the service READs each item's embeddings over NIXL into its
  own pool before vLLM sees the request; vLLM's worker copies them from there into its encoder
  cache (`read_item`), a local copy that never waits on the network.

Plain types only: descriptors cross vLLM's msgpack (API process -> EngineCore) and its pickle
(EngineCore -> Worker). Imports no vLLM (the services build descriptors before vLLM starts).
"""

from __future__ import annotations

import contextlib
import mmap
import os
from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class SlotDescriptor:
    """Where one item's tensors lie in a service's shared pool."""

    key: str  # the service's name of the item (its `written` mark, its failure report)
    request_id: str  # the service's request id (failure messages)
    item: int  # the item's position in the request
    pool_path: str  # `MemoryPool.share_path` of the service's pool
    slot_offset: int  # byte offset of the item's slot in the pool (its stamp area first)
    rows: int  # the project's layout: rows every tensor has
    dtype: str  # torch dtype name of the slot's tensors ("float32", ...)
    tensors: tuple[tuple[str, int, int], ...]  # (name, byte offset in the pool, width), in vLLM's order

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(raw: dict[str, Any]) -> SlotDescriptor:
        raw = dict(raw)
        raw["tensors"] = tuple((str(n), int(o), int(w)) for n, o, w in raw["tensors"])
        return SlotDescriptor(**raw)

    @property
    def width(self) -> int:
        """Of vLLM's encoder-cache entry: the tensors side by side on the last dimension."""
        return sum(w for _, _, w in self.tensors)

    def views(self, buffer: Any) -> list[torch.Tensor]:
        """The item's tensors in the mapped pool `buffer`, [rows, width] each, in vLLM's order."""
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"items[{self.item}]: unknown slot dtype {self.dtype!r}")
        return [
            torch.frombuffer(buffer, dtype=dtype, count=self.rows * width, offset=offset).view(self.rows, width)
            for _, offset, width in self.tensors
        ]


def vllm_order(names: list[str]) -> list[str]:
    """vLLM's encoder-cache layout: Qwen3-VL keeps the deepstack features next to the embeddings
    on the last dimension (embeddings, deepstack.0, deepstack.1, ...)."""
    extras = sorted((n for n in names if n.startswith("deepstack.")), key=lambda n: int(n.split(".")[1]))
    return ["embeddings", *extras]


def slot_of(received: Any, pool: Any, *, key: str, request_id: str, item: int) -> SlotDescriptor:
    """The descriptor of tensors a service READ into its shared `pool` (`ReceivedTensors`)."""
    pool_path = pool.share_path
    assert pool_path is not None, "embeddings for vLLM are read into a shared pool"
    tensors = dict(received.tensors)
    names = vllm_order(list(tensors))
    if set(names) != set(tensors):
        raise ValueError(f"items[{item}]: tensors {sorted(tensors)} are not an encoder-cache entry")
    placed = []
    for name in names:
        tensor = tensors[name]
        offset = tensor.data_ptr() - pool.base_address
        if not tensor.is_contiguous() or tensor.dim() != 2 or not 0 <= offset <= pool.capacity - tensor.nbytes:
            raise ValueError(f"items[{item}]: {name} does not lie in the shared pool")
        placed.append((name, offset, int(tensor.shape[1])))
    first = tensors["embeddings"]
    return SlotDescriptor(
        key=key,
        request_id=request_id,
        item=item,
        pool_path=pool_path,
        slot_offset=min(offset for _, offset, _ in placed),
        rows=int(first.shape[0]),
        dtype=str(first.dtype).removeprefix("torch."),
        tensors=tuple(placed),
    )


def read_item(buffer: Any, slot: SlotDescriptor, *, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The item's encoder-cache entry, our own copy on `device` in `dtype` (the slot goes back to
    the service's pool once the request is done)."""
    views = slot.views(buffer)
    joined = views[0] if len(views) == 1 else torch.cat(views, dim=-1)  # cat copies already
    return joined.to(device=device, dtype=dtype, copy=len(views) == 1)


class PoolMaps:
    """Services' shared pools mapped in this process (vLLM's worker), once per path."""

    def __init__(self) -> None:
        self._maps: dict[str, mmap.mmap] = {}

    def get(self, path: str) -> mmap.mmap:
        region = self._maps.get(path)
        if region is None:
            fd = os.open(path, os.O_RDWR)
            try:
                region = self._maps[path] = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED)
            finally:
                os.close(fd)  # the mapping keeps the memory
        return region

    def close(self) -> None:
        for region in self._maps.values():
            with contextlib.suppress(BufferError, ValueError):
                region.close()
        self._maps.clear()
