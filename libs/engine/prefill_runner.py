"""PrefillRunner: text + embeddings at placeholder positions → KV cache and the first token."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from libs.engine.errors import EmbeddingMismatchError
from libs.engine.kv import export_kv
from libs.engine.lm_runtime import LanguageModelRuntime
from libs.engine.prompt import Prompt, build_prompt
from libs.engine.sequence import Sequence
from libs.engine.types import ChatMessage, DecodeState, EncodedItem, PrefillResult, SamplingParams


class PrefillRunner:
    def __init__(self, runtime: LanguageModelRuntime, *, default_max_tokens: int = 256) -> None:
        self.runtime = runtime
        self.default_max_tokens = default_max_tokens
        self.specs = {spec.modality: spec for spec in runtime.expected_specs()}

    def _check_item(self, index: int, item: EncodedItem) -> None:
        spec = self.specs[item.layout.modality]
        field = f"items[{index}].embeddings"
        emb = item.tensors.get("embeddings")
        count = item.layout.placeholder_token_count
        if emb is None or emb.dim() != 2 or emb.shape[0] != count or emb.shape[1] != spec.width:
            shape = None if emb is None else tuple(emb.shape)
            raise EmbeddingMismatchError(f"embeddings {shape}, layout wants [{count}, {spec.width}]", field=field)
        if not emb.is_floating_point():
            raise EmbeddingMismatchError(f"embeddings dtype {emb.dtype} is not floating point", field=field)
        wanted = {e.name: e for e in spec.extra_tensors}
        if set(item.tensors) - {"embeddings"} != set(wanted):
            raise EmbeddingMismatchError(f"extra tensors {sorted(item.tensors)} != {sorted(wanted)}", field=field)
        for name, extra in wanted.items():
            t = item.tensors[name]
            if tuple(t.shape) != (count, extra.width):
                raise EmbeddingMismatchError(f"{name} is {tuple(t.shape)}, wants [{count}, {extra.width}]", field=field)

    def build(self, messages: list[ChatMessage]) -> Prompt:
        prompt = build_prompt(self.runtime.tokenizer, self.runtime.adapter, messages)
        for i, item in enumerate(prompt.encoded):
            self._check_item(i, item)
        return prompt

    def inputs(self, prompt: Prompt) -> tuple[torch.Tensor, torch.Tensor, int, dict[str, torch.Tensor] | None]:
        """inputs_embeds [1, L, H], position ids [3, 1, L], rope delta, family extras."""
        runtime = self.runtime
        ids = torch.tensor([prompt.input_ids], dtype=torch.long)
        embeds = runtime.embed(ids)
        for placed, item in zip(prompt.items, prompt.encoded, strict=True):
            row = 0
            for start, rows in placed.row_spans():
                embeds[0, start : start + rows] = item.embeddings[row : row + rows].to(embeds.dtype)
                row += rows
        positions, rope_delta = runtime.adapter.position_ids(prompt.input_ids, prompt.items)
        extras = runtime.adapter.prefill_extras(
            prompt.items, [item.tensors for item in prompt.encoded], len(prompt.input_ids)
        )
        return embeds, positions.unsqueeze(1), rope_delta, extras

    def prefill(
        self, messages: list[ChatMessage], sampling: SamplingParams, *, return_logits: bool = False
    ) -> PrefillResult:
        sequence = Sequence(self.runtime, sampling, default_max_tokens=self.default_max_tokens)
        prompt = self.build(messages)
        with torch.inference_mode():
            embeds, positions, rope_delta, extras = self.inputs(prompt)
            cache = DynamicCache()
            logits = self.runtime.adapter.lm_forward(self.runtime.module, embeds, positions, cache, None, extras)
            row = logits[0, -1].float()
            token, chunk = sequence.advance(row)
            kv = None if sequence.finished else export_kv(self.runtime, cache)
        state = DecodeState(
            next_input_token_id=token,
            rope_delta=rope_delta,
            generated_tokens=sequence.generated,
            generated_text=sequence.text,
            prompt_tokens=len(prompt.input_ids),
        )
        return PrefillResult(chunk, kv, state, row.clone() if return_logits else None)
