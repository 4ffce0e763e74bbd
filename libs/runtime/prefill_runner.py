"""PrefillRunner: text + embeddings at placeholder positions → KV cache and the first token."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from libs.model.errors import EmbeddingMismatchError, PrefixMissError
from libs.model.prompt import Prompt, build_prompt
from libs.model.types import ChatMessage, DecodeState, EncodedItem, PrefillResult, SamplingParams
from libs.runtime.encoder_decoder import EncoderDecoderPrefill
from libs.runtime.kv import build_cache, cache_layers, export_kv
from libs.runtime.lm_runtime import LanguageModelRuntime
from libs.runtime.prefix_cache import PrefixCache
from libs.runtime.sequence import Sequence

# Tokens per chunk when a service runs a prefill in chunks (services: --prefill-chunk-tokens): a text
# request waits at most one chunk in progress, short next to a whole image prompt, and the
# per-forward overhead stays small.
CHUNK_TOKENS = 64


class PrefillRunner:
    def __init__(
        self,
        runtime: LanguageModelRuntime,
        *,
        default_max_tokens: int = 256,
        chunk_tokens: int = CHUNK_TOKENS,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.runtime = runtime
        self.default_max_tokens = default_max_tokens
        self.chunk_tokens = chunk_tokens  # prompt tokens per forward when run in chunks (services)
        self.prefix_cache = prefix_cache  # None: every prompt is forwarded whole
        self.specs = {spec.modality: spec for spec in runtime.expected_specs()}

    @property
    def holds_items(self) -> bool:
        """Whether its prefix cache can stand in for items' embeddings (contract 1.9, `prefix_held`):
        a family with per-token extras (deepstack) prefills whole, past the cache, and an
        encoder-decoder model keeps no prefix."""
        extras = any(spec.extra_tensors for spec in self.specs.values())
        return self.prefix_cache is not None and not extras and not self.runtime.adapter.is_encoder_decoder

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
        self,
        messages: list[ChatMessage],
        sampling: SamplingParams,
        *,
        return_logits: bool = False,
        cache_salt: str = "",
    ) -> PrefillResult:
        task = self.start(messages, sampling, cache_salt=cache_salt)
        while not task.step(task.remaining):
            pass
        return task.finish(return_logits=return_logits)

    def start(
        self, messages: list[ChatMessage], sampling: SamplingParams, *, cache_salt: str = ""
    ) -> PrefillTask | EncoderDecoderPrefill:
        """A prefill to run in chunks (`PrefillTask.step`), so that other work (short prefills, decode
        steps) can run between them; `prefill` is start + every step + finish. `cache_salt` scopes
        the prefix cache (the caller's tenant): prompts reuse only blocks of their own salt."""
        if self.runtime.adapter.is_encoder_decoder:  # Whisper: the decoder's task prompt, one step
            return EncoderDecoderPrefill(self.runtime, messages, sampling, default_max_tokens=self.default_max_tokens)
        return PrefillTask(self, messages, sampling, cache_salt)


class PrefillTask:
    """One prompt's prefill, forwarded `step(n)` tokens at a time into one KV cache. Chunking is
    exact attention over the cached prefix (the same result up to float rounding), and so is
    starting from blocks of the runner's prefix cache; families with extra per-token inputs
    (deepstack) run in one step, whole."""

    def __init__(
        self, runner: PrefillRunner, messages: list[ChatMessage], sampling: SamplingParams, cache_salt: str = ""
    ) -> None:
        self.runner = runner
        self.sequence = Sequence(runner.runtime, sampling, default_max_tokens=runner.default_max_tokens)
        self.prompt = runner.build(messages)
        self.sequence.set_prompt(self.prompt.input_ids)
        with torch.inference_mode():
            self.embeds, self.positions, self.rope_delta, self.extras = runner.inputs(self.prompt)
        self.cache = DynamicCache()
        self.done = 0
        self.total = int(self.embeds.shape[1])
        self.logits: torch.Tensor | None = None
        self.block_keys: list[bytes] = []
        prefixes = runner.prefix_cache
        if prefixes is not None and self.extras is None:
            scope = f"{runner.runtime.weights_digest}\0{cache_salt}"
            self.block_keys = prefixes.keys(scope, self.prompt.input_ids, self.prompt.items, self.prompt.encoded)
            self.done, layers = prefixes.lookup(self.block_keys, self.total)
            if layers is not None:
                self.cache = build_cache(layers, [])  # type: ignore[assignment]
        self.cached_tokens = self.done  # prompt tokens whose KV came from the prefix cache
        missing = [
            index
            for index, (placed, item) in enumerate(zip(self.prompt.items, self.prompt.encoded, strict=True))
            if item.held and any(start + rows > self.done for start, rows in placed.row_spans())
        ]
        if missing:  # its zeros would be forwarded as if they were the image
            raise PrefixMissError(
                f"items[{missing[0]}] was sent as held in the prefix cache, which covers {self.done} of the "
                f"prompt's {self.total} tokens: send its embeddings",
                field=f"items[{missing[0]}]",
            )
        # Per modality, items whose every embedding row lies in that prefix (they were not needed).
        self.reused_items: dict[str, int] = {}
        for placed in self.prompt.items:
            if all(start + rows <= self.done for start, rows in placed.row_spans()):
                kind = placed.layout.modality.value
                self.reused_items[kind] = self.reused_items.get(kind, 0) + 1

    @property
    def remaining(self) -> int:
        return self.total - self.done

    def step(self, tokens: int) -> bool:
        """Forward the next `tokens` prompt tokens (all of them with extras); True when finished."""
        end = self.total if self.extras is not None or tokens <= 0 else min(self.total, self.done + tokens)
        runtime = self.runner.runtime
        with torch.inference_mode():
            self.logits = runtime.adapter.lm_forward(
                runtime.module,
                self.embeds[:, self.done : end],
                self.positions[:, :, self.done : end],
                self.cache,
                None,
                self.extras,
            )
        self.done = end
        return self.done >= self.total

    def finish(self, *, return_logits: bool = False) -> PrefillResult:
        """Sample the first token from the last chunk's logits and export the KV cache."""
        assert self.logits is not None and self.remaining == 0, "finish() before every step ran"
        if self.block_keys and self.runner.prefix_cache is not None:
            self.runner.prefix_cache.store(self.block_keys, cache_layers(self.cache))
        with torch.inference_mode():
            row = self.logits[0, -1].float()
            token, chunk = self.sequence.advance(row)
            kv = None if self.sequence.finished else export_kv(self.runner.runtime, self.cache)
        state = DecodeState(
            next_input_token_id=token,
            rope_delta=self.rope_delta,
            generated_tokens=self.sequence.generated,
            generated_text=self.sequence.text,
            prompt_tokens=len(self.prompt.input_ids),
            # Decode's repetition penalty looks at the prompt's tokens; sent only then.
            prompt_token_ids=tuple(self.prompt.input_ids) if self.sequence.sampling.repetition_penalty != 1 else (),
            cached_prompt_tokens=self.cached_tokens,
        )
        return PrefillResult(chunk, kv, state, row.clone() if return_logits else None)
