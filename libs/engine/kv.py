"""KV cache export/import as plain contiguous per-layer tensors [num_kv_heads, num_tokens, head_dim]."""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from libs.engine.errors import KvMismatchError
from libs.engine.lm_runtime import LanguageModelRuntime
from libs.engine.types import KvCache


def kv_names(layer: int) -> tuple[str, str]:
    return f"layers.{layer}.key", f"layers.{layer}.value"


def cache_layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer [batch, kv_heads, tokens, head_dim] key and value tensors of a dynamic cache."""
    layers: list[Any] = list(cache.layers)
    return [(layer.keys, layer.values) for layer in layers]


def export_kv(runtime: LanguageModelRuntime, cache: DynamicCache, *, row: int = 0, start: int = 0) -> KvCache:
    """Copy sequence `row` (from token `start` on, skipping left padding) out of a cache."""
    tensors: dict[str, torch.Tensor] = {}
    num_tokens = 0
    for i, (keys, values) in enumerate(cache_layers(cache)):
        key_name, value_name = kv_names(i)
        tensors[key_name] = keys[row, :, start:, :].contiguous().clone()
        tensors[value_name] = values[row, :, start:, :].contiguous().clone()
        num_tokens = tensors[key_name].shape[1]
    return KvCache(runtime.kv_layout(num_tokens), tensors, runtime.weights_digest)


def check_kv(runtime: LanguageModelRuntime, kv: KvCache) -> None:
    """Refuse a cache from another model or with a shape this model cannot use."""
    if kv.weights_digest != runtime.weights_digest:
        raise KvMismatchError("KV cache comes from a different model (weights digest differs)", field="kv_cache")
    expected = runtime.kv_layout(kv.layout.num_tokens)
    if kv.layout != expected:
        raise KvMismatchError(f"KV layout {kv.layout} does not match this model's {expected}", field="kv_cache.layout")
    shape = (expected.num_kv_heads, expected.num_tokens, expected.head_dim)
    for i in range(expected.num_layers):
        for name in kv_names(i):
            tensor = kv.tensors.get(name)
            if tensor is None or tuple(tensor.shape) != shape or tensor.dtype != runtime.dtype:
                raise KvMismatchError(f"KV tensor {name} missing or mis-shaped", field="kv_cache.handle")
    if len(kv.tensors) != 2 * expected.num_layers:
        raise KvMismatchError("KV cache has unexpected tensors", field="kv_cache.handle")


def layer_tensors(kv: KvCache, num_layers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(kv.tensors[kv_names(i)[0]], kv.tensors[kv_names(i)[1]]) for i in range(num_layers)]
