"""What a model service sees of its engine, whichever it is.

A service picks its engine with `--engine reference|vllm` (`EPD_ENGINE`) and advertises it in
`ServiceInfo.capabilities` as `engine.<name>`, so a peer checks at first contact that it can hand
over to it (embeddings are engine-neutral; a KV cache is not: its layout is the engine's).

The prefill-decode role (E+PD layout) is the unit both engines implement: a metadata-only
conversation in (media parts are `encoded` references to encoder-held embeddings), the token
stream out. Where the embeddings are read (the service's own transport for the reference engine,
the vLLM worker's EC connector for vLLM) is the engine's business.

The prefill and decode roles (E/P/D layout) of an engine that moves the KV cache itself (vLLM:
`PrefillEngine`, `DecodeEngine`) take and give the wire messages, since the handoff between them
(`KvCache.paged`, `DecodeState.engine_prompt`) is the engine's; the reference engine's prefill and
decode services move the KV with the service's transport (services/prefill, services/decode).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from libs.backends.identity import ENGINES, capability, engine_capabilities, engine_of
from libs.contract.epd.v1 import chat_pb2, decode_pb2, generation_pb2, prefill_pb2
from libs.runtime import types as eng

__all__ = [
    "ENGINES",
    "DecodeEngine",
    "PrefillDecodeEngine",
    "PrefillEngine",
    "Streamed",
    "capability",
    "engine_capabilities",
    "engine_of",
]

# One streamed message: the chunk, and usage on the last one.
Streamed = tuple[generation_pb2.TokenChunk, generation_pb2.Usage | None]


class PrefillDecodeEngine(Protocol):
    """Prefill + decode of metadata-only requests in one service (the PD role)."""

    name: str  # "reference" | "vllm"
    weights_digest: str  # the checkpoint digest every role advertises

    def expected_specs(self) -> list[eng.EmbeddingSpec]:
        """Per-modality embeddings this engine consumes (checked against the encoders' specs)."""
        ...

    @property
    def active(self) -> int:
        """Sequences being generated."""
        ...

    def generate(
        self,
        request_id: str,
        messages: Sequence[chat_pb2.ChatMessage],
        sampling: eng.SamplingParams,
        deadline: float | None,
        priority: int = 0,
    ) -> AsyncIterator[Streamed]:
        """Stream the reply; typed contract errors for bad input, a gone embedding, a dead engine.
        `priority` (epd.v1's: higher first) orders the requests waiting inside the engine."""
        ...

    async def close(self) -> None:
        """Stop the engine and free what it holds."""
        ...


class PrefillEngine(Protocol):
    """Prefill of metadata-only requests (the P role): the first token and the KV handoff."""

    name: str
    weights_digest: str

    def expected_specs(self) -> list[eng.EmbeddingSpec]: ...

    async def prefill(
        self, request: prefill_pb2.PrefillRequest, deadline: float | None
    ) -> prefill_pb2.PrefillResponse: ...

    async def close(self) -> None: ...


class DecodeEngine(Protocol):
    """Decode from a prefill's KV handoff (the D role): the token stream."""

    name: str
    weights_digest: str

    def decode(self, request: decode_pb2.DecodeRequest, deadline: float | None) -> AsyncIterator[Streamed]: ...

    async def close(self) -> None: ...
