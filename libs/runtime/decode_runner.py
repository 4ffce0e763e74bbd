"""DecodeRunner: continues sequences from imported KV caches, all active sequences in one batched
forward per step (left-padded cache + attention mask), not one request at a time. Encoder-decoder
models' cross-attention KV (one fixed length per model) is stacked beside it, never padded."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from libs.model.errors import CapacityError, InvalidRequestError
from libs.model.types import DecodeState, KvCache, SamplingParams, TokenChunk
from libs.runtime.kv import (
    Cache,
    build_cache,
    cache_layers,
    check_kv,
    cross_layers,
    cross_tensors,
    export_kv,
    layer_tensors,
)
from libs.runtime.lm_runtime import LanguageModelRuntime
from libs.runtime.sequence import Sequence


@dataclass
class _Active:
    request_id: str
    sequence: Sequence
    next_token: int
    rope_delta: int
    length: int  # tokens in the cache
    kv: KvCache | None  # own copy while not part of the batched cache


class DecodeRunner:
    def __init__(self, runtime: LanguageModelRuntime, *, max_batch: int = 8, default_max_tokens: int = 256) -> None:
        self.runtime = runtime
        self.max_batch = max_batch
        self.default_max_tokens = default_max_tokens
        self._active: list[_Active] = []
        self._cache: Cache | None = None
        self._mask: torch.Tensor | None = None  # [B, cache_len], 0 on left padding

    @property
    def active_ids(self) -> list[str]:
        return [a.request_id for a in self._active]

    def add(self, request_id: str, kv: KvCache, state: DecodeState, sampling: SamplingParams) -> None:
        """Import a KV cache and queue the sequence for the next step."""
        if len(self._active) >= self.max_batch:
            raise CapacityError(f"decode batch is full ({self.max_batch})", field="request_id")
        if request_id in self.active_ids:
            raise InvalidRequestError(f"request {request_id} is already decoding", field="request_id")
        check_kv(self.runtime, kv)
        if kv.layout.num_tokens != state.prompt_tokens + state.generated_tokens - 1:
            raise InvalidRequestError("KV length does not match the decode state", field="decode_state")
        if state.prompt_token_ids and len(state.prompt_token_ids) != state.prompt_tokens:
            raise InvalidRequestError(
                "prompt_token_ids do not match prompt_tokens", field="decode_state.prompt_token_ids"
            )
        if sampling.repetition_penalty != 1 and not state.prompt_token_ids:
            raise InvalidRequestError(
                "the repetition penalty needs the prompt's token ids (a prefill speaking contract 1.6 sends them)",
                field="decode_state.prompt_token_ids",
            )
        sequence = Sequence(
            self.runtime,
            sampling,
            default_max_tokens=self.default_max_tokens,
            generated_tokens=state.generated_tokens,
            generated_text=state.generated_text,
            last_token_id=state.next_input_token_id,
            prompt_tokens=state.prompt_tokens,
            prompt_token_ids=state.prompt_token_ids,
        )
        self._unbatch()
        self._active.append(
            _Active(request_id, sequence, state.next_input_token_id, state.rope_delta, kv.layout.num_tokens, kv)
        )

    def cancel(self, request_id: str) -> None:
        self._unbatch()
        self._active = [a for a in self._active if a.request_id != request_id]

    def _unbatch(self) -> None:
        """Give every sequence its own KV copy again (before the batch membership changes)."""
        if self._cache is None:
            return
        width = self._cache.get_seq_length()
        for row, active in enumerate(self._active):
            if active.kv is None:
                active.kv = export_kv(self.runtime, self._cache, row=row, start=width - active.length)
        self._cache = None
        self._mask = None

    def _batch(self) -> None:
        longest = max(a.length for a in self._active)
        layers = []
        for layer in range(self.runtime.num_layers):
            keys, values = [], []
            for active in self._active:
                assert active.kv is not None
                k, v = layer_tensors(active.kv, self.runtime.num_layers)[layer]
                pad = longest - active.length
                keys.append(torch.nn.functional.pad(k, (0, 0, pad, 0)))
                values.append(torch.nn.functional.pad(v, (0, 0, pad, 0)))
            layers.append((torch.stack(keys), torch.stack(values)))
        cross = []
        for layer in range(self.runtime.num_layers if self.runtime.cross_tokens else 0):
            pairs = [cross_tensors(a.kv, self.runtime.num_layers)[layer] for a in self._active if a.kv is not None]
            cross.append((torch.stack([k for k, _ in pairs]), torch.stack([v for _, v in pairs])))
        self._cache = build_cache(layers, cross)
        self._mask = torch.stack([torch.arange(longest) >= longest - a.length for a in self._active]).long()
        for active in self._active:
            active.kv = None

    def step(self, *, return_logits: bool = False) -> dict[str, tuple[TokenChunk, torch.Tensor | None]]:
        """One batched forward over all active sequences; finished sequences leave the batch."""
        if not self._active:
            return {}
        if self._cache is None:
            self._batch()
        assert self._cache is not None and self._mask is not None
        runtime = self.runtime
        tokens = torch.tensor([[a.next_token] for a in self._active], dtype=torch.long)
        positions = torch.tensor([[a.length + a.rope_delta] for a in self._active], dtype=torch.long)
        mask = torch.cat([self._mask, torch.ones(len(self._active), 1, dtype=torch.long)], dim=1)
        with torch.inference_mode():
            embeds = runtime.embed(tokens)
            # An all-ones mask is dropped so a lone sequence runs exactly like prefill did.
            attention = None if bool(mask.all()) else mask
            logits = runtime.adapter.lm_forward(
                runtime.module, embeds, positions.unsqueeze(0).expand(3, -1, -1), self._cache, attention
            )
        self._mask = mask
        out: dict[str, tuple[TokenChunk, torch.Tensor | None]] = {}
        finished = False
        for row, active in enumerate(self._active):
            active.length += 1
            row_logits = logits[row, -1].float()
            token, chunk = active.sequence.advance(row_logits)
            active.next_token = token
            out[active.request_id] = (chunk, row_logits.clone() if return_logits else None)
            finished = finished or chunk.finish_reason is not None
        if finished:
            keep = [i for i, a in enumerate(self._active) if a.sequence.finished is None]
            self._unbatch_rows(keep)
        return out

    def _unbatch_rows(self, keep: list[int]) -> None:
        assert self._cache is not None and self._mask is not None
        index = torch.tensor(keep, dtype=torch.long)
        self._active = [self._active[i] for i in keep]
        if not keep:
            self._cache = None
            self._mask = None
            return
        # Drop finished rows and any left-padding columns no remaining sequence needs.
        width = self._cache.get_seq_length()
        trim = width - max(a.length for a in self._active)
        layers = [(k[index, :, trim:, :], v[index, :, trim:, :]) for k, v in cache_layers(self._cache)]
        self._cache = build_cache(layers, [(k[index], v[index]) for k, v in cross_layers(self._cache)])
        self._mask = self._mask[index, trim:]

    def run(self, *, return_logits: bool = False) -> dict[str, list[tuple[TokenChunk, torch.Tensor | None]]]:
        """Step until every active sequence has finished (convenience for tests and benchmarks)."""
        out: dict[str, list[tuple[TokenChunk, torch.Tensor | None]]] = {a: [] for a in self.active_ids}
        while self._active:
            for request_id, item in self.step(return_logits=return_logits).items():
                out[request_id].append(item)
        return out
