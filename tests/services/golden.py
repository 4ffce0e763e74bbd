"""Expected tokens for the golden tests: the colocated model's own `generate()` (greedy), fed by
the family's preprocessing, for the engine test mixes turned into client requests."""

from __future__ import annotations

from typing import Any

import torch

from libs.contract.epd.v1 import chat_pb2, generate_pb2, media_pb2, sampling_pb2
from libs.engine.encoder_runner import media_hash
from libs.engine.lm_runtime import LanguageModelRuntime
from libs.engine.media.limits import MediaLimits
from libs.engine.prompt import build_prompt
from libs.engine.types import ChatMessage, ChatRole, EncodedItem, EncodedPart, Modality, TextPart
from libs.serving.convert import MODALITY_TO_WIRE
from tests.engine.mixes import Mix
from tests.engine.reference import reference_generate, reference_inputs

MAX_TOKENS = 8


def expected_tokens(model: Any, runtime: LanguageModelRuntime, encoder_adapter: Any, mix: Mix) -> list[int]:
    prepared = [encoder_adapter.preprocess(m, media_hash(m), MediaLimits()) for m in mix.media]
    items = [EncodedItem(p.layout, {"embeddings": torch.zeros(p.layout.placeholder_token_count, 1)}) for p in prepared]
    parts = tuple(TextPart(p) if isinstance(p, str) else EncodedPart(items[p]) for p in mix.parts)
    prompt = build_prompt(runtime.tokenizer, runtime.adapter, [ChatMessage(ChatRole.USER, parts)])
    order = [prepared[next(i for i, it in enumerate(items) if it is e)] for e in prompt.encoded]
    tokens, _ = reference_generate(model, reference_inputs(prompt.input_ids, order), MAX_TOKENS)
    return list(tokens)


def request_for(mix: Mix, *, max_tokens: int = MAX_TOKENS, request_id: str = "") -> generate_pb2.GenerateRequest:
    """The mix as a client request: one user turn, parts in the mix's order."""
    assert [p for p in mix.parts if isinstance(p, int)] == list(range(len(mix.media))), "media in order"
    parts = []
    for part in mix.parts:
        if isinstance(part, str):
            parts.append(chat_pb2.ContentPart(text=part))
        else:
            media = mix.media[part]
            parts.append(
                chat_pb2.ContentPart(
                    media=media_pb2.MediaItem(modality=MODALITY_TO_WIRE[media.modality], data=media.data)
                )
            )
    return generate_pb2.GenerateRequest(
        request_id=request_id,
        messages=[chat_pb2.ChatMessage(role=chat_pb2.CHAT_ROLE_USER, parts=parts)],
        sampling=sampling_pb2.SamplingParams(max_tokens=max_tokens),
    )


ALL_MODALITIES = frozenset(Modality)
