"""The language-model half of a checkpoint, shared by PrefillRunner and DecodeRunner."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer
from transformers.utils import logging as hf_logging

from libs.model.checkpoint import Checkpoint, load_into
from libs.model.dtypes import dtype_name
from libs.model.errors import InvalidRequestError
from libs.model.families import adapter_for
from libs.model.types import EmbeddingSpec, ExtraTensorSpec, KvCacheLayout


class LanguageModelRuntime:
    """Loads only language-model tensors, the tokenizer and the end-of-sequence ids."""

    def __init__(self, model_path: str | Path, *, dtype: torch.dtype = torch.float32) -> None:
        self.checkpoint = Checkpoint(model_path)
        self.adapter = adapter_for(self.checkpoint)
        self.dtype = dtype
        # AutoTokenizer parses config.json; full Omni configs warn about talker ids we never use.
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
        try:
            self.tokenizer: Any = AutoTokenizer.from_pretrained(str(self.checkpoint.path))
        finally:
            hf_logging.set_verbosity(verbosity)
        tensors = self.checkpoint.load(self.adapter.lm_tensor_name)
        self.module = self.adapter.build_language_model()
        self.adapter.finish_language_model(self.module, tensors)
        load_into(self.module, tensors, "language model")
        self.module.to(dtype).eval()
        self.weights_digest = self.checkpoint.weights_digest()
        self.eos_token_ids = self._eos_ids()
        text = self.adapter.text_config
        self.num_layers = int(text.num_hidden_layers)
        self.num_kv_heads = int(text.num_key_value_heads)
        self.head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
        self.cross_tokens = self.adapter.cross_attention_tokens  # 0 for decoder-only models

    def _eos_ids(self) -> frozenset[int]:
        gen = self.checkpoint.json_file("generation_config.json")
        raw = gen.get("eos_token_id", self.tokenizer.eos_token_id)
        ids = raw if isinstance(raw, list) else [raw]
        return frozenset(int(i) for i in ids if i is not None)

    def expected_specs(self) -> list[EmbeddingSpec]:
        """What prefill accepts per modality (for the service info)."""
        name = dtype_name(self.dtype)
        return [
            EmbeddingSpec(
                modality,
                self.adapter.hidden_size,
                name,
                tuple(
                    ExtraTensorSpec(n, self.adapter.hidden_size, name)
                    for n in self.adapter.embedding_extra_names(modality)
                ),
            )
            for modality in sorted(self.adapter.modalities, key=lambda m: m.value)
        ]

    def kv_layout(self, num_tokens: int, cross_tokens: int = 0) -> KvCacheLayout:
        return KvCacheLayout(
            self.num_layers, self.num_kv_heads, self.head_dim, num_tokens, dtype_name(self.dtype), cross_tokens
        )

    def max_new_tokens(self, prompt_tokens: int, requested: int, default: int) -> int:
        """Tokens a sequence may generate: `requested` (0: `default`), within the model's positions
        (Whisper: prompt + generated <= max_target_positions, as generate()'s max_length)."""
        limit = self.adapter.max_positions
        if limit is None:
            return requested or default
        room = limit - prompt_tokens
        if requested > room:
            raise InvalidRequestError(
                f"max_tokens {requested} exceeds the {room} positions left after a {prompt_tokens}-token prompt",
                field="sampling.max_tokens",
            )
        return requested or room

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.module.embed(input_ids)  # type: ignore[operator]
        return out
