"""Prefill of encoder-decoder models (Whisper): the decoder's task prompt over one item's encoder
states. One decoder forward builds the self-attention KV of the prompt and every layer's
cross-attention KV from the encoder states; both go to decode. Same interface as the decoder-only
`PrefillTask` (`remaining`, `step`, `finish`), in one step."""

from __future__ import annotations

import torch

from libs.model.errors import EmbeddingMismatchError
from libs.model.prompt import speech_item
from libs.model.types import ChatMessage, DecodeState, EncodedItem, PrefillResult, SamplingParams
from libs.runtime.kv import export_kv
from libs.runtime.lm_runtime import LanguageModelRuntime
from libs.runtime.sequence import Sequence


def encoder_states(runtime: LanguageModelRuntime, messages: list[ChatMessage]) -> EncodedItem:
    """The conversation's one item of encoder states, checked against the model."""
    field, item = speech_item(runtime.adapter.family, messages)
    rows, width = runtime.cross_tokens, runtime.adapter.hidden_size
    emb = item.tensors.get("embeddings")
    if item.layout.cross_attention_rows != rows or set(item.tensors) != {"embeddings"}:
        raise EmbeddingMismatchError(
            f"layout has {item.layout.cross_attention_rows} cross-attention rows and tensors {sorted(item.tensors)}; "
            f"this model takes {rows} rows of encoder states",
            field=f"{field}.encoded.layout",
        )
    if emb is None or tuple(emb.shape) != (rows, width) or not emb.is_floating_point():
        shape = None if emb is None else tuple(emb.shape)
        raise EmbeddingMismatchError(f"encoder states {shape}, want [{rows}, {width}]", field=f"{field}.encoded")
    return item


class EncoderDecoderPrefill:
    def __init__(
        self,
        runtime: LanguageModelRuntime,
        messages: list[ChatMessage],
        sampling: SamplingParams,
        *,
        default_max_tokens: int,
    ) -> None:
        self.runtime = runtime
        self.item = encoder_states(runtime, messages)
        self.prompt_ids = runtime.adapter.decoder_prompt(sampling)
        self.sequence = Sequence(
            runtime,
            sampling,
            default_max_tokens=default_max_tokens,
            prompt_tokens=len(self.prompt_ids),
            prompt_token_ids=self.prompt_ids,
        )
        self.cache = runtime.adapter.new_cache()
        self.logits: torch.Tensor | None = None

    @property
    def remaining(self) -> int:
        return 0 if self.logits is not None else len(self.prompt_ids)

    def step(self, tokens: int = 0) -> bool:
        """The whole decoder prompt in one forward (it is a few tokens)."""
        runtime = self.runtime
        with torch.inference_mode():
            ids = torch.tensor([self.prompt_ids], dtype=torch.long)
            positions = torch.arange(len(self.prompt_ids)).view(1, 1, -1).expand(3, 1, -1)
            states = self.item.embeddings.to(runtime.dtype).unsqueeze(0)
            self.logits = runtime.adapter.lm_forward(
                runtime.module, runtime.embed(ids), positions, self.cache, None, {"encoder_states": states}
            )
        return True

    def finish(self, *, return_logits: bool = False) -> PrefillResult:
        assert self.logits is not None, "finish() before step()"
        with torch.inference_mode():
            row = self.logits[0, -1].float()
            token, chunk = self.sequence.advance(row)
            kv = None if self.sequence.finished else export_kv(self.runtime, self.cache)
        state = DecodeState(
            next_input_token_id=token,
            rope_delta=0,
            generated_tokens=self.sequence.generated,
            generated_text=self.sequence.text,
            prompt_tokens=len(self.prompt_ids),
            prompt_token_ids=tuple(self.prompt_ids) if self.sequence.sampling.repetition_penalty != 1 else (),
        )
        return PrefillResult(chunk, kv, state, row.clone() if return_logits else None)
