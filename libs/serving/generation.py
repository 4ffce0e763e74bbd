"""Prefill followed by decode in one process (PD and colocated services)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from libs.contract.epd.v1 import generation_pb2
from libs.engine import types as eng
from libs.engine.prefill_runner import PrefillRunner
from libs.serving.convert import chunk_to_wire, engine_errors
from libs.serving.engine_loop import DecodeLoop, EngineThread

Streamed = tuple[generation_pb2.TokenChunk, generation_pb2.Usage | None]


async def prefill_then_decode(
    engine: EngineThread,
    prefill: PrefillRunner,
    decode: DecodeLoop,
    request_id: str,
    messages: list[eng.ChatMessage],
    sampling: eng.SamplingParams,
) -> AsyncIterator[Streamed]:
    """Stream `(chunk, usage)`; usage is set on the last chunk only."""
    with engine_errors():
        result = await engine.run(prefill.prefill, messages, sampling)
    state = result.decode_state
    generated = len(result.first_chunk.token_ids)
    if result.kv_cache is None:
        yield (
            chunk_to_wire(result.first_chunk),
            generation_pb2.Usage(prompt_tokens=state.prompt_tokens, completion_tokens=generated),
        )
        return
    yield chunk_to_wire(result.first_chunk), None
    async for item in decode_stream(decode, request_id, result.kv_cache, state, sampling, already=generated):
        yield item


async def decode_stream(
    decode: DecodeLoop,
    request_id: str,
    kv: eng.KvCache,
    state: eng.DecodeState,
    sampling: eng.SamplingParams,
    *,
    already: int,
) -> AsyncIterator[Streamed]:
    """Decode from `kv`, counting `already` generated tokens into the final usage."""
    generated = already
    with engine_errors():
        async for chunk in decode.stream(request_id, kv, state, sampling):
            generated += len(chunk.token_ids)
            usage = None
            if chunk.finish_reason is not None:
                usage = generation_pb2.Usage(prompt_tokens=state.prompt_tokens, completion_tokens=generated)
            yield chunk_to_wire(chunk), usage
