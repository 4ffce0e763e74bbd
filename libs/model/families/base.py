"""The family adapter interface.

An adapter says, for one checkpoint family: which tensors belong to the encoders and which to the
language model (and their module-local names); how media is preprocessed and what layout results;
how an encoder batch runs; how placeholders expand in the prompt; how (M-RoPE) position ids are
built; and how the language model runs one forward over a KV cache.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from libs.model.checkpoint import Checkpoint
from libs.model.errors import InvalidRequestError
from libs.model.media.limits import MediaLimits
from libs.model.types import EmbeddingSpec, ItemLayout, MediaInput, Modality, SamplingParams


@dataclass
class PreparedItem:
    """A preprocessed media item, ready for its tower: tower inputs plus its final layout."""

    layout: ItemLayout
    inputs: dict[str, torch.Tensor]


@dataclass(frozen=True)
class PlacedItem:
    """Where an item's embedding rows sit in the token sequence: `spans` of (position, rows), in row
    order (one span, or one per video frame when the family puts text between frames)."""

    start: int
    layout: ItemLayout
    spans: tuple[tuple[int, int], ...] = ()

    def row_spans(self) -> tuple[tuple[int, int], ...]:
        return self.spans or ((self.start, self.layout.placeholder_token_count),)


@dataclass(frozen=True)
class Expansion:
    """What replaces the chat template's placeholder token for one item.

    `spans` are (offset in `tokens`, rows) where embedding rows go, in row order. `absorb` names
    token ids the template puts right before / after the placeholder that the expansion replaces
    (Qwen3-VL video repeats the vision start/end tokens per frame instead)."""

    tokens: list[int]
    spans: tuple[tuple[int, int], ...]
    absorb: tuple[int | None, int | None] = (None, None)


@dataclass(frozen=True)
class PromptExtras:
    """Per-request tensors some families feed the language model besides embeddings."""

    tensors: dict[str, torch.Tensor]


class FamilyAdapter(abc.ABC):
    family: str
    modalities: frozenset[Modality]
    # Encoder-decoder models (Whisper): encoder outputs feed the decoder's cross-attention, the
    # prompt is the decoder's task prompt (`decoder_prompt`), the KV carries cross-attention too.
    is_encoder_decoder = False

    def __init__(self, checkpoint: Checkpoint) -> None:
        self.checkpoint = checkpoint

    # ---- weights -------------------------------------------------------------------------
    @abc.abstractmethod
    def encoder_tensor_name(self, name: str) -> str | None:
        """Module-local name of an encoder tensor in the encoder module; None if not an encoder tensor."""

    @abc.abstractmethod
    def lm_tensor_name(self, name: str) -> str | None:
        """Module-local name of a language-model tensor; None if not a language-model tensor."""

    @abc.abstractmethod
    def build_encoder(self) -> torch.nn.Module:
        """Empty encoder module (towers only) for `encoder_tensor_name` tensors."""

    @abc.abstractmethod
    def build_language_model(self) -> torch.nn.Module:
        """Empty language model (embeddings, decoder layers, head) for `lm_tensor_name` tensors."""

    def finish_language_model(self, module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:  # noqa: B027
        """Hook for tied weights and the like, before loading (default: nothing)."""

    # ---- text ------------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def hidden_size(self) -> int: ...

    @property
    @abc.abstractmethod
    def text_config(self) -> Any: ...

    @abc.abstractmethod
    def placeholder_token(self, modality: Modality) -> str:
        """The single token the chat template emits for one item of this modality."""

    @abc.abstractmethod
    def content_type(self, modality: Modality) -> str:
        """Content-part type the chat template expects ("image", "video", "audio")."""

    def expand_placeholder(self, layout: ItemLayout, placeholder_id: int, tokenizer: Any) -> Expansion:
        """Tokens replacing the template's placeholder token. Default: `placeholder_token_count`
        copies of the placeholder, all embedding rows."""
        count = layout.placeholder_token_count
        return Expansion([placeholder_id] * count, ((0, count),))

    # ---- media ----------------------------------------------------------------------------
    @abc.abstractmethod
    def preprocess(self, media: MediaInput, mm_hash: str, limits: MediaLimits) -> PreparedItem: ...

    @abc.abstractmethod
    def encode(
        self, encoder: torch.nn.Module, modality: Modality, items: list[PreparedItem]
    ) -> list[dict[str, torch.Tensor]]:
        """Run one forward for a batch of items of one modality; tensors per item."""

    def embedding_extra_names(self, modality: Modality) -> tuple[str, ...]:
        """Names of extra tensors emitted per item (e.g. deepstack); default none."""
        return ()

    @abc.abstractmethod
    def dummy_media(self, modality: Modality) -> MediaInput:
        """A small valid item, encoded at start-up to measure the embedding spec."""

    # ---- positions and the language model ---------------------------------------------------
    @abc.abstractmethod
    def position_ids(self, input_ids: list[int], items: list[PlacedItem]) -> tuple[torch.Tensor, int]:
        """M-RoPE position ids [3, len] for a prompt and its rope delta."""

    @abc.abstractmethod
    def lm_forward(
        self,
        lm: torch.nn.Module,
        inputs_embeds: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Any,  # a DynamicCache; an EncoderDecoderCache for encoder-decoder models
        attention_mask: torch.Tensor | None,
        extras: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Logits [batch, len, vocab] for one forward; the cache grows in place."""

    def prefill_extras(
        self, items: list[PlacedItem], tensors: list[dict[str, torch.Tensor]], length: int
    ) -> dict[str, torch.Tensor] | None:
        """Extra language-model inputs implied by the items (deepstack); default none."""
        return None

    def check_spec(self, spec: EmbeddingSpec) -> None:  # noqa: B027 - optional hook
        """Hook for family-specific spec checks (default: none)."""

    # ---- encoder-decoder models ------------------------------------------------------------
    @property
    def cross_attention_tokens(self) -> int:
        """Encoder states per item the decoder cross-attends to (0: decoder-only)."""
        return 0

    @property
    def max_positions(self) -> int | None:
        """Longest decoder sequence (prompt + generated), when the model has one."""
        return None

    def decoder_prompt(self, sampling: SamplingParams) -> list[int]:
        """The decoder's task prompt (encoder-decoder models)."""
        raise InvalidRequestError(f"{self.family} is not an encoder-decoder model", field="messages")

    def new_cache(self) -> Any:
        """An empty KV cache for one prefill."""
        return DynamicCache()

    def process_logits(self, logits: torch.Tensor, sampled: list[int], sampling: SamplingParams) -> torch.Tensor:
        """The family's logits processors for one sequence's [vocab] row (`sampled`: tokens generated
        so far); default: none. Raises for sampling options the family does not know."""
        if sampling.timestamps:
            raise InvalidRequestError(f"{self.family} has no timestamp tokens", field="sampling.timestamps")
        return logits
