"""Prefill and the token stream after it, shared by the prefill, decode, PD and colocated services."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence

from libs.contract.epd.v1 import chat_pb2, generation_pb2
from libs.engine import types as eng
from libs.engine.prefill_runner import PrefillRunner
from libs.serving.convert import chunk_to_wire, engine_errors, messages_to_engine
from libs.serving.embeddings import FetchedItems, fetch_encoded
from libs.serving.engine_loop import DecodeLoop, EngineThread
from libs.serving.transport import Transport
from libs.telemetry.stages import record_duration, stage, start_phase

Streamed = tuple[generation_pb2.TokenChunk, generation_pb2.Usage | None]


async def run_prefill(
    engine: EngineThread,
    runner: PrefillRunner,
    messages: Sequence[chat_pb2.ChatMessage],
    sampling: eng.SamplingParams,
    fetched: FetchedItems,
) -> eng.PrefillResult:
    """Prefill on the engine thread; the fetched embedding slots go back once the engine is done
    with them - even when the caller is cancelled mid-prefill."""
    with stage("prefill.compute", "prefill") as span:
        task = asyncio.ensure_future(engine.run(runner.prefill, messages_to_engine(messages, fetched.items), sampling))
        try:
            with engine_errors():
                result = await asyncio.shield(task)
        finally:
            if task.done():
                fetched.release()
            else:
                task.add_done_callback(lambda _: fetched.release())
        span.set_attribute("epd.prompt_tokens", result.decode_state.prompt_tokens)
        return result


async def fetch_and_prefill(
    engine: EngineThread,
    runner: PrefillRunner,
    transport: Transport,
    messages: Sequence[chat_pb2.ChatMessage],
    sampling: eng.SamplingParams,
    deadline: float | None,
) -> eng.PrefillResult:
    """Read a metadata-only request's embeddings from the encoders, then prefill."""
    specs = {spec.modality: spec for spec in runner.runtime.expected_specs()}
    fetched = await fetch_encoded(transport, messages, specs, deadline)
    return await run_prefill(engine, runner, messages, sampling, fetched)


async def stream_after_prefill(
    decode: DecodeLoop, request_id: str, result: eng.PrefillResult, sampling: eng.SamplingParams
) -> AsyncIterator[Streamed]:
    """The first chunk, then decode in this process; usage on the last chunk."""
    state = result.decode_state
    if result.kv_cache is None:
        usage = generation_pb2.Usage(prompt_tokens=state.prompt_tokens, completion_tokens=state.generated_tokens)
        yield chunk_to_wire(result.first_chunk), usage
        return
    yield chunk_to_wire(result.first_chunk), None
    async for item in decode_stream(decode, request_id, result.kv_cache, state, sampling):
        yield item


async def decode_stream(
    decode: DecodeLoop, request_id: str, kv: eng.KvCache, state: eng.DecodeState, sampling: eng.SamplingParams
) -> AsyncIterator[Streamed]:
    """Decode from `kv` (after `state.generated_tokens` tokens); usage on the last chunk."""
    generated = state.generated_tokens
    # Not made current: the stream's consumer resumes it from other frames.
    span = start_phase("decode.generate", **{"epd.stage": "decode"})
    started = time.perf_counter()
    first: float | None = None
    try:
        with engine_errors():
            async for chunk in decode.stream(request_id, kv, state, sampling):
                if first is None and chunk.token_ids:
                    first = time.perf_counter() - started
                generated += len(chunk.token_ids)
                usage = None
                if chunk.finish_reason is not None:
                    usage = generation_pb2.Usage(prompt_tokens=state.prompt_tokens, completion_tokens=generated)
                yield chunk_to_wire(chunk), usage
    finally:
        elapsed = time.perf_counter() - started
        tokens = generated - state.generated_tokens
        span.set_attributes(
            {
                "epd.decode.tokens": tokens,
                "epd.decode.first_token_s": first or 0.0,
                "epd.decode.inter_token_s": (elapsed - (first or 0.0)) / (tokens - 1) if tokens > 1 else 0.0,
            }
        )
        span.end()
        record_duration("decode.generate", "decode", elapsed)
