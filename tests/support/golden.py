"""Expected tokens for the golden tests: the colocated model's own `generate()` (greedy), fed by the
family's own transformers processor and the tokenizer's chat template (not by the project's
preprocessing), for the engine test mixes turned into client requests."""

from __future__ import annotations

from typing import Any

from libs.contract.epd.v1 import chat_pb2, generate_pb2, media_pb2, sampling_pb2
from libs.model.types import Modality
from libs.runtime.lm_runtime import LanguageModelRuntime
from libs.serving.convert import MODALITY_TO_WIRE
from tests.support.mixes import Mix
from tests.support.reference import reference_generate, reference_inputs

MAX_TOKENS = 8


def expected_tokens(model: Any, runtime: LanguageModelRuntime, encoder_adapter: Any, mix: Mix) -> list[int]:
    """Greedy tokens for `mix`. `runtime` only names the checkpoint, and `encoder_adapter` is not used:
    the inputs come from the family's processor (the signature stays for the fixtures' call)."""
    tokens, _ = reference_generate(model, reference_inputs(runtime.checkpoint.path, mix), MAX_TOKENS)
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
