"""Engine-level data. Field names follow proto/epd/v1 (layout, service_info, prefill, sampling) so the
services can map them 1:1; nothing here imports protobuf."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from libs.engine.errors import EmbeddingMismatchError


class Modality(enum.Enum):
    IMAGE = "image"
    VIDEO = "video"
    AUDIO = "audio"


# Element types the engine emits, by the name the services map onto epd.v1.DType.
DTYPE_BY_NAME: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
NAME_BY_DTYPE: dict[torch.dtype, str] = {v: k for k, v in DTYPE_BY_NAME.items()}


def dtype_name(dtype: torch.dtype) -> str:
    return NAME_BY_DTYPE[dtype]


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

    def check(self) -> None:
        """Raise if the detail arm does not match the modality or the count is not positive."""
        arms = {Modality.IMAGE: self.image, Modality.VIDEO: self.video, Modality.AUDIO: self.audio}
        if arms[self.modality] is None or sum(a is not None for a in arms.values()) != 1:
            raise EmbeddingMismatchError(
                f"layout detail does not match modality {self.modality.value}", field="layout.detail"
            )
        if self.placeholder_token_count <= 0:
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


@dataclass(frozen=True)
class MediaInput:
    modality: Modality
    data: bytes
    item_index: int = 0
    options: ProcessorOptions = field(default_factory=ProcessorOptions)


@dataclass
class EncodedItem:
    """One encoded item: layout plus tensors ("embeddings" [count, width] and any extras)."""

    layout: ItemLayout
    tensors: dict[str, torch.Tensor]

    @property
    def embeddings(self) -> torch.Tensor:
        return self.tensors["embeddings"]


class ChatRole(enum.Enum):
    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"


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


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    STOP_SEQUENCE = "stop_sequence"


@dataclass
class TokenChunk:
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None


@dataclass(frozen=True)
class KvCacheLayout:
    """Shape of an exported cache: 2 * num_layers tensors, each [num_kv_heads, num_tokens, head_dim]."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_tokens: int
    dtype: str


@dataclass
class KvCache:
    """Per-layer KV as plain contiguous tensors named "layers.<i>.key" / "layers.<i>.value"."""

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


@dataclass
class PrefillResult:
    first_chunk: TokenChunk
    kv_cache: KvCache | None  # None when generation already finished at the first token
    decode_state: DecodeState
    logits: torch.Tensor | None = None  # last-position logits, when asked for (tests)
