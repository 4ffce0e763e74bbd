"""vLLM's EC connector copies each item from the service's shared pool into vLLM's encoder cache, on
the engine's device and in its dtype (the zeros of a failed copy too), with Qwen3-VL's deepstack
features beside the embeddings. Imports vLLM (no engine starts)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from libs.backends.vllm.shared_pool import SlotDescriptor, read_item, slot_of
from libs.transfer.pool import MemoryPool

pytestmark = pytest.mark.vllm

ROWS = 3


@pytest.fixture
def pool() -> Iterator[MemoryPool]:
    shared = MemoryPool(1 << 20, huge_pages=False, shared=True)
    yield shared
    shared.close()


def _received(pool: MemoryPool, widths: dict[str, int]) -> SimpleNamespace:
    """What a service's READ leaves: tensors viewing one slot of its pool (names in any order)."""
    slot = pool.allocate(4096 + sum(ROWS * w * 4 for w in widths.values()))
    tensors, offset = {}, slot.offset + 4096  # the slot's stamp area first
    for index, (name, width) in enumerate(widths.items()):
        view = torch.frombuffer(pool.buffer, dtype=torch.float32, count=ROWS * width, offset=offset)
        view.copy_(torch.full((ROWS * width,), float(index + 1)))
        tensors[name] = view.view(ROWS, width)
        offset += ROWS * width * 4
    return SimpleNamespace(tensors=tensors)


def test_a_read_item_is_copied_in_vllms_order_and_survives_msgpack(pool: MemoryPool) -> None:
    received = _received(pool, {"deepstack.1": 2, "embeddings": 4, "deepstack.0": 3})
    slot = slot_of(received, pool, key="u1", request_id="r1", item=0)
    assert [name for name, _, _ in slot.tensors] == ["embeddings", "deepstack.0", "deepstack.1"]
    assert (slot.rows, slot.width, slot.dtype, slot.pool_path) == (ROWS, 9, "float32", pool.share_path)
    assert SlotDescriptor.from_dict(json.loads(json.dumps(slot.to_dict()))) == slot  # plain types only
    got = read_item(pool.buffer, slot, device=torch.device("cpu"), dtype=torch.float32)
    want = torch.cat([received.tensors[name] for name in ("embeddings", "deepstack.0", "deepstack.1")], 1)
    assert torch.equal(got, want)
    got.add_(1)  # our own copy: the pool's bytes are untouched
    assert torch.equal(received.tensors["embeddings"], torch.full((ROWS, 4), 2.0))


def test_tensors_outside_the_shared_pool_are_refused(pool: MemoryPool) -> None:
    elsewhere = SimpleNamespace(tensors={"embeddings": torch.zeros(ROWS, 4)})
    with pytest.raises(ValueError, match="does not lie in the shared pool"):
        slot_of(elsewhere, pool, key="u1", request_id="r1", item=2)


def test_copies_and_failure_zeros_land_on_the_engines_device(pool: MemoryPool, tmp_path: Path) -> None:
    """The `meta` device stands in for a GPU: any device but the pool's CPU memory."""
    from libs.backends.vllm.ec_connector import EpdECConnector, engine_device
    from libs.backends.vllm.requests import failure_path
    from libs.backends.vllm.shared_pool import PoolMaps

    meta = torch.device("meta")
    assert engine_device(SimpleNamespace(device_config=SimpleNamespace(device=meta))) == meta
    assert engine_device(SimpleNamespace(device_config=SimpleNamespace(device="cuda"))) == torch.device("cuda")
    connector = object.__new__(EpdECConnector)  # the worker side only: no vLLM config needed
    connector._device, connector._dtype, connector._failed = meta, torch.bfloat16, set()
    connector._failure_dir, connector._maps = tmp_path, PoolMaps()
    slot = slot_of(_received(pool, {"embeddings": 4}), pool, key="u1", request_id="r1", item=0)
    cache: dict[str, torch.Tensor] = {}
    connector._load("u1", slot.to_dict(), cache)
    assert cache["u1"].device == meta and cache["u1"].dtype == torch.bfloat16 and cache["u1"].shape == (ROWS, 4)
    assert connector._failed == set()

    gone = SlotDescriptor(**{**slot.to_dict(), "key": "u2", "request_id": "r2", "pool_path": str(tmp_path / "gone")})
    connector._load("u2", gone.to_dict(), cache)
    assert cache["u2"].device == meta and cache["u2"].shape == (ROWS, 4) and connector._failed == {"r2"}
    report = json.loads(failure_path(tmp_path, "r2").read_text())
    assert report["code"] == "INTERNAL" and "items[0]" in report["message"]
    connector.shutdown()
