"""KV cache export/import as plain contiguous per-layer tensors [num_kv_heads, num_tokens, head_dim].

Encoder-decoder models (Whisper) also carry each layer's cross-attention KV, built once from the
encoder states at prefill: "layers.<i>.cross_key" / "layers.<i>.cross_value", each
[num_kv_heads, cross_tokens, head_dim]. In memory they live in an `EncoderDecoderCache`.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache, EncoderDecoderCache

from libs.model.errors import KvMismatchError
from libs.model.types import KvCache
from libs.runtime.lm_runtime import LanguageModelRuntime

Cache = DynamicCache | EncoderDecoderCache


def kv_names(layer: int) -> tuple[str, str]:
    return f"layers.{layer}.key", f"layers.{layer}.value"


def cross_kv_names(layer: int) -> tuple[str, str]:
    return f"layers.{layer}.cross_key", f"layers.{layer}.cross_value"


def all_kv_names(num_layers: int, *, cross: bool) -> list[str]:
    names = [name for i in range(num_layers) for name in kv_names(i)]
    return names + ([name for i in range(num_layers) for name in cross_kv_names(i)] if cross else [])


def self_attention(cache: Cache) -> DynamicCache:
    return cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache


def cache_layers(cache: Cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer [batch, kv_heads, tokens, head_dim] self-attention key and value tensors."""
    layers: list[Any] = list(self_attention(cache).layers)
    return [(layer.keys, layer.values) for layer in layers]


def cross_layers(cache: Cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer cross-attention key and value tensors (none for a decoder-only cache)."""
    if not isinstance(cache, EncoderDecoderCache):
        return []
    layers: list[Any] = list(cache.cross_attention_cache.layers)
    return [(layer.keys, layer.values) for layer in layers]


def build_cache(
    self_layers: list[tuple[torch.Tensor, torch.Tensor]], cross: list[tuple[torch.Tensor, torch.Tensor]]
) -> Cache:
    """A cache holding these [batch, heads, tokens, head_dim] tensors; with cross-attention layers it
    is an `EncoderDecoderCache` whose cross-attention is marked computed (never rebuilt)."""
    own = DynamicCache(ddp_cache_data=self_layers)
    return EncoderDecoderCache(own, DynamicCache(ddp_cache_data=cross)) if cross else own


def export_kv(runtime: LanguageModelRuntime, cache: Cache, *, row: int = 0, start: int = 0) -> KvCache:
    """Copy sequence `row` (from token `start` on, skipping left padding) out of a cache."""
    tensors: dict[str, torch.Tensor] = {}
    num_tokens = 0
    for i, (keys, values) in enumerate(cache_layers(cache)):
        key_name, value_name = kv_names(i)
        tensors[key_name] = keys[row, :, start:, :].contiguous().clone()
        tensors[value_name] = values[row, :, start:, :].contiguous().clone()
        num_tokens = tensors[key_name].shape[1]
    cross_tokens = 0
    for i, (keys, values) in enumerate(cross_layers(cache)):
        key_name, value_name = cross_kv_names(i)
        tensors[key_name] = keys[row].contiguous().clone()
        tensors[value_name] = values[row].contiguous().clone()
        cross_tokens = tensors[key_name].shape[1]
    return KvCache(runtime.kv_layout(num_tokens, cross_tokens), tensors, runtime.weights_digest)


def check_kv(runtime: LanguageModelRuntime, kv: KvCache) -> None:
    """Refuse a cache from another model or with a shape this model cannot use."""
    if kv.weights_digest != runtime.weights_digest:
        raise KvMismatchError("KV cache comes from a different model (weights digest differs)", field="kv_cache")
    expected = runtime.kv_layout(kv.layout.num_tokens, runtime.cross_tokens)
    if kv.layout != expected:
        raise KvMismatchError(f"KV layout {kv.layout} does not match this model's {expected}", field="kv_cache.layout")
    for i in range(expected.num_layers):
        wanted = [(name, expected.num_tokens) for name in kv_names(i)]
        wanted += [(name, expected.cross_tokens) for name in cross_kv_names(i)] if expected.cross_tokens else []
        for name, tokens in wanted:
            tensor = kv.tensors.get(name)
            shape = (expected.num_kv_heads, tokens, expected.head_dim)
            if tensor is None or tuple(tensor.shape) != shape or tensor.dtype != runtime.dtype:
                raise KvMismatchError(f"KV tensor {name} missing or mis-shaped", field="kv_cache.handle")
    if len(kv.tensors) != len(all_kv_names(expected.num_layers, cross=bool(expected.cross_tokens))):
        raise KvMismatchError("KV cache has unexpected tensors", field="kv_cache.handle")


def layer_tensors(kv: KvCache, num_layers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(kv.tensors[kv_names(i)[0]], kv.tensors[kv_names(i)[1]]) for i in range(num_layers)]


def cross_tensors(kv: KvCache, num_layers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if not kv.layout.cross_tokens:
        return []
    return [(kv.tensors[cross_kv_names(i)[0]], kv.tensors[cross_kv_names(i)[1]]) for i in range(num_layers)]
