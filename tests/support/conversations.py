"""A two-turn conversation that keeps its image, as a chat client sends it: the second turn
resends the first with its answer, then asks again. Its first message fills several prefill
chunks, so the prefix the first turn leaves is long enough for any engine's prefix cache."""

from __future__ import annotations

from libs.contract.epd.v1 import chat_pb2, generate_pb2, media_pb2, sampling_pb2
from libs.launch.stack import Stack
from libs.model.media import synthetic
from tests.support.stacks import pool_stats

IMAGE = media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=synthetic.png_bytes(448, 448, seed=11))
QUESTION = "look at the picture and tell me " + " ".join(f"what part {i} shows" for i in range(60))


def _message(role: chat_pb2.ChatRole.ValueType, *parts: chat_pb2.ContentPart) -> chat_pb2.ChatMessage:
    return chat_pb2.ChatMessage(role=role, parts=list(parts))


def turn(salt: str, answer: str | None, max_tokens: int = 8) -> generate_pb2.GenerateRequest:
    """The first turn, or (given the first turn's `answer`) the second, in tenant `salt`."""
    messages = [
        _message(chat_pb2.CHAT_ROLE_USER, chat_pb2.ContentPart(media=IMAGE), chat_pb2.ContentPart(text=QUESTION))
    ]
    if answer is not None:
        messages += [
            _message(chat_pb2.CHAT_ROLE_ASSISTANT, chat_pb2.ContentPart(text=answer)),
            _message(chat_pb2.CHAT_ROLE_USER, chat_pb2.ContentPart(text="and what colour is it")),
        ]
    return generate_pb2.GenerateRequest(
        messages=messages, sampling=sampling_pb2.SamplingParams(max_tokens=max_tokens), cache_salt=salt
    )


def encoder_leases(stack: Stack) -> int:
    """Embeddings the stack's encoders produced so far (one lease per item encoded): what a turn
    that needs no encoder leaves unchanged."""
    total = 0
    for name, process in stack.processes.items():
        if name.startswith("encoder-"):
            pool = pool_stats(process.address).pool
            total += pool.active_leases + pool.acked_leases + pool.released_leases + pool.expired_leases
    return total
