"""Engine-level data. Field names follow proto/epd/v1 (layout, service_info, prefill, sampling) so the
services can map them 1:1; nothing here imports protobuf."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from libs.model.errors import EmbeddingMismatchError

if TYPE_CHECKING:  # torch only in annotations: the router and the cache keys use these without it
    import torch


class Modality(enum.Enum):
    IMAGE = "image"
    VIDEO = "video"
    AUDIO = "audio"


# Element types the engine emits, by the name the services map onto epd.v1.DType.


@dataclass(frozen=True)
class ImageLayout:
    """Patch grid of one image, in patches before the spatial merge."""

    grid_t: int
    grid_h: int
    grid_w: int


@dataclass(frozen=True)
class VideoLayout:
    """Patch grid and timing of one video."""

    grid_t: int
    grid_h: int
    grid_w: int
    seconds_per_grid: float  # seconds one temporal patch spans in the source
    grid_timestamps_s: tuple[float, ...]  # start time of each temporal patch, grid_t entries
    sampled_frames: int


@dataclass(frozen=True)
class AudioLayout:
    feature_length: int  # mel frames fed to the audio tower
    output_length: int  # embedding rows produced
    duration_s: float
    # Encoder-decoder speech models (Whisper) encode one fixed window of the clip's features at a
    # time; all 0 for towers that take the whole clip (Qwen2.5-Omni).
    window_start_frame: int = 0  # first mel frame of this window in the clip (generate()'s `seek`)
    window_frames: int = 0  # mel frames of the clip inside the window (the rest is padding)
    clip_frames: int = 0  # mel frames of the whole clip as generate() counts them


@dataclass(frozen=True)
class ItemLayout:
    """Everything prefill needs, besides the embedding bytes, to place one item in the prompt."""

    modality: Modality
    item_index: int
    mm_hash: str
    placeholder_token_count: int
    image: ImageLayout | None = None
    video: VideoLayout | None = None
    audio: AudioLayout | None = None
    # Encoder-decoder models: the rows are encoder states the decoder cross-attends to, not prompt
    # embeddings; `placeholder_token_count` is then 0 (the item takes no prompt positions).
    cross_attention_rows: int = 0

    @property
    def rows(self) -> int:
        """Rows of the item's "embeddings" tensor."""
        return self.cross_attention_rows or self.placeholder_token_count

    def check(self) -> None:
        """Raise if the detail arm does not match the modality or the count is not positive."""
        arms = {Modality.IMAGE: self.image, Modality.VIDEO: self.video, Modality.AUDIO: self.audio}
        if arms[self.modality] is None or sum(a is not None for a in arms.values()) != 1:
            raise EmbeddingMismatchError(
                f"layout detail does not match modality {self.modality.value}", field="layout.detail"
            )
        if self.cross_attention_rows < 0 or (self.cross_attention_rows and self.placeholder_token_count):
            raise EmbeddingMismatchError(
                "cross-attention items take no placeholder tokens", field="layout.placeholder_token_count"
            )
        if self.rows <= 0:
            raise EmbeddingMismatchError("placeholder_token_count must be > 0", field="layout.placeholder_token_count")


@dataclass(frozen=True)
class ExtraTensorSpec:
    name: str  # e.g. "deepstack.0"
    width: int
    dtype: str


@dataclass(frozen=True)
class EmbeddingSpec:
    """Encoder output for one modality, measured at start-up on a dummy item."""

    modality: Modality
    width: int
    dtype: str
    extra_tensors: tuple[ExtraTensorSpec, ...] = ()


@dataclass(frozen=True)
class ProcessorOptions:
    """Per-item preprocessing overrides; unset fields take the checkpoint's defaults."""

    min_pixels: int | None = None
    max_pixels: int | None = None
    video_fps: float | None = None
    video_max_frames: int | None = None

    def as_dict(self) -> dict[str, object]:
        """The fields by name (`dataclasses.asdict` without its deep copy: every item hashes this)."""
        return dict(vars(self))


@dataclass(frozen=True)
class MediaInput:
    modality: Modality
    data: bytes
    item_index: int = 0
    options: ProcessorOptions = field(default_factory=ProcessorOptions)
    # Encoder-decoder speech models (Whisper), long-form: encode the 30 s window of the clip that
    # starts at this mel frame (generate()'s `seek`). Engine-only until the contract carries it (a
    # wire ProcessorOptions field); 0, the first window, leaves the content hash as it was.
    audio_window_start_frame: int = 0


@dataclass
class EncodedItem:
    """One encoded item: layout plus tensors ("embeddings" [count, width] and any extras)."""

    layout: ItemLayout
    tensors: dict[str, torch.Tensor]
    # Stands in for an item whose rows the prefix cache must hold (contract 1.9, `prefix_held`): its
    # tensors are zeros of the right shape, never forwarded; a prefill not covering every row fails.
    held: bool = False

    @property
    def embeddings(self) -> torch.Tensor:
        return self.tensors["embeddings"]


class ChatRole(enum.Enum):
    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    RAW = "raw"  # the prompt itself, no chat template (contract 1.6)


@dataclass(frozen=True)
class TextPart:
    text: str


@dataclass(frozen=True)
class EncodedPart:
    item: EncodedItem


@dataclass(frozen=True)
class ChatMessage:
    role: ChatRole
    parts: tuple[TextPart | EncodedPart, ...]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 selects greedy decoding
    top_p: float = 1.0
    top_k: int = 0  # 0 disables
    seed: int | None = None
    max_tokens: int = 0  # 0 takes the runner's default
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    # Speech models with timestamp tokens (Whisper): predict them (generate(return_timestamps=True)).
    timestamps: bool = False
    # Since contract 1.6, with vLLM's semantics (vllm/model_executor/layers/utils.py apply_penalties).
    presence_penalty: float = 0.0  # subtracted once from each already generated token's logit
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # over prompt + generated tokens; 1 is off
    min_tokens: int = 0  # EOS and stop_token_ids suppressed (and stop strings unmatched) until then
    ignore_eos: bool = False  # EOS tokens do not end generation
    logprobs: int | None = None  # None: none; k: the chosen token's plus the k most likely


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    STOP_SEQUENCE = "stop_sequence"


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float  # raw model distribution (log-softmax of the logits), nats
    token: str  # the token decoded alone


@dataclass(frozen=True)
class TokenLogprobs:
    chosen: TokenLogprob
    top: tuple[TokenLogprob, ...]  # the k most likely, descending


@dataclass
class TokenChunk:
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per token id, when the sampling asks for them


@dataclass(frozen=True)
class KvCacheLayout:
    """Shape of an exported cache: 2 * num_layers tensors, each [num_kv_heads, num_tokens, head_dim],
    plus for encoder-decoder models 2 * num_layers cross-attention tensors, each
    [num_kv_heads, cross_tokens, head_dim]."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_tokens: int
    dtype: str
    cross_tokens: int = 0  # encoder states the cross-attention KV was built from; 0: none


@dataclass
class KvCache:
    """Per-layer KV as plain contiguous tensors named "layers.<i>.key" / "layers.<i>.value" (and
    "layers.<i>.cross_key" / "layers.<i>.cross_value" for encoder-decoder models)."""

    layout: KvCacheLayout
    tensors: dict[str, torch.Tensor]
    weights_digest: str  # digest of the language-model weights that produced it


@dataclass(frozen=True)
class DecodeState:
    next_input_token_id: int
    rope_delta: int
    generated_tokens: int
    generated_text: str
    prompt_tokens: int
    # The prompt's token ids (placeholders expanded), for the repetition penalty; () when not needed.
    prompt_token_ids: tuple[int, ...] = ()
    cached_prompt_tokens: int = 0  # prompt tokens whose KV came from a cached prefix


@dataclass
class PrefillResult:
    first_chunk: TokenChunk
    kv_cache: KvCache | None  # None when generation already finished at the first token
    decode_state: DecodeState
    logits: torch.Tensor | None = None  # last-position logits, when asked for (tests)
