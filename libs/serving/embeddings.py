"""Prefill's side of the E->P handoff: read every encoded item's embeddings from the encoders that
hold them (one batched fetch, READs in flight together), acknowledged by the transfer library, and
present them to the engine as `EncodedItem`s viewing this process's pool (no copy)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from libs.contract.epd.v1 import chat_pb2
from libs.contract.errors import DeadlineExceeded
from libs.contract.reasons import Reason
from libs.model import types as eng
from libs.serving import convert
from libs.serving.transport import Transport, transport_name
from libs.telemetry.stages import record_transfer, stage
from libs.transfer import ExpectedTensor, ReceivedTensors


@dataclass
class FetchedItems:
    """Items for the engine; `release()` returns their slots once the engine is done with them."""

    items: list[eng.EncodedItem]
    received: list[ReceivedTensors] = field(default_factory=list)

    def release(self) -> None:
        self.release_all(self.received)
        self.received.clear()

    @staticmethod
    def release_all(received: Sequence[ReceivedTensors]) -> None:
        for item in received:
            item.release()


def _expectation(spec: eng.EmbeddingSpec, rows: int) -> dict[str, ExpectedTensor]:
    expected = {"embeddings": ExpectedTensor(convert.DTYPE_TO_WIRE[spec.dtype], (rows, spec.width))}
    for extra in spec.extra_tensors:
        expected[extra.name] = ExpectedTensor(convert.DTYPE_TO_WIRE[extra.dtype], (rows, extra.width))
    return expected


async def fetch_encoded(
    transport: Transport,
    messages: Sequence[chat_pb2.ChatMessage],
    specs: dict[eng.Modality, eng.EmbeddingSpec],
    deadline: float | None,
) -> FetchedItems:
    """Fetch the embeddings of every `encoded` part, checked against what this model consumes."""
    every = convert.media_parts(messages)
    held = {index: _held_item(part, specs) for index, part in enumerate(every) if part.encoded.prefix_held}
    parts = [part for part in every if not part.encoded.prefix_held]
    if not parts:
        return FetchedItems(list(held.values()))
    assert transport.consumer is not None
    layouts = [convert.item_layout_to_engine(p.encoded.layout) for p in parts]
    expected = [_expectation(specs[layout.modality], layout.rows) for layout in layouts]
    timeout = None
    if deadline is not None:
        timeout = deadline - time.monotonic()
        if timeout <= 0:
            raise DeadlineExceeded("deadline passed before the embeddings were read")
    handles = [p.encoded.embeddings for p in parts]
    with stage("embeddings.transfer", "transfer") as span:
        started = time.perf_counter()
        received = await transport.run(
            transport.consumer.fetch_many,
            handles,
            expected=expected,
            timeout_s=timeout,
            on_abandon=FetchedItems.release_all,
            gone=Reason.EMBEDDING_GONE,
        )
        record_transfer(
            span,
            nbytes=sum(r.nbytes for r in received),
            seconds=time.perf_counter() - started,
            transport=transport_name(handles),
            peers=len({h.agent.producer_address for h in handles}),
            direction="encoder->prefill",
        )
    read = iter([eng.EncodedItem(layout, dict(r.tensors)) for layout, r in zip(layouts, received, strict=True)])
    return FetchedItems([held[index] if index in held else next(read) for index in range(len(every))], received)


def _held_item(part: chat_pb2.ContentPart, specs: dict[eng.Modality, eng.EmbeddingSpec]) -> eng.EncodedItem:
    """An item held in the prefix cache (contract 1.9): zeros of its shape stand in for embeddings
    the prefill never forwards (`PrefillTask` checks that the cache covers every row)."""
    layout = convert.item_layout_to_engine(part.encoded.layout)
    spec = specs[layout.modality]
    tensors = {
        name: torch.zeros(layout.rows, width, dtype=getattr(torch, dtype))
        for name, width, dtype in (
            ("embeddings", spec.width, spec.dtype),
            *((extra.name, extra.width, extra.dtype) for extra in spec.extra_tensors),
        )
    }
    return eng.EncodedItem(layout, tensors, held=True)
