"""vLLM's EC connector puts what it reads (and the zeros of a failed read) on the engine's device,
not in the CPU pool it read into. Imports vLLM (no engine starts)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.vllm


def test_embeddings_and_failure_zeros_land_on_the_engines_device(tmp_path: Path) -> None:
    """The EC connector's copies go where vLLM's encoder cache lives (here the `meta` device stands
    in for a GPU: any device but the pool's CPU memory)."""
    from libs.backends.vllm.ec_connector import EpdECConnector, engine_device
    from libs.backends.vllm.requests import ItemDescriptor
    from libs.transfer import TransferFailed

    meta = torch.device("meta")
    assert engine_device(SimpleNamespace(device_config=SimpleNamespace(device=meta))) == meta
    assert engine_device(SimpleNamespace(device_config=SimpleNamespace(device="cuda"))) == torch.device("cuda")
    connector = object.__new__(EpdECConnector)  # the worker side only: no vLLM config needed
    connector._device, connector._dtype, connector._failed = meta, torch.bfloat16, set()
    connector._failure_dir = tmp_path
    item = ItemDescriptor("r1", "", "agent", "", False, rows=3, width=4, tensors=(), deadline=0.0)
    released: list[str] = []

    class Received:
        def __init__(self) -> None:
            self.tensors = {"embeddings": torch.ones(3, 2), "deepstack.0": torch.ones(3, 2)}

        def release(self) -> None:
            released.append("slot")

    cache: dict[str, torch.Tensor] = {}
    connector._fetch = lambda items: [Received()]  # type: ignore[method-assign,list-item]
    connector._load("r1", {"u1": item}, cache)
    assert cache["u1"].device == meta and cache["u1"].dtype == torch.bfloat16 and cache["u1"].shape == (3, 4)
    assert released == ["slot"]

    def gone(items: Any) -> Any:
        raise TransferFailed("encoder gone")

    connector._fetch = gone  # type: ignore[method-assign]
    connector._load("r2", {"u2": item}, cache)
    assert cache["u2"].device == meta and cache["u2"].shape == (3, 4) and connector._failed == {"r2"}
