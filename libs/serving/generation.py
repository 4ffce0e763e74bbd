"""Prefill and the token stream after it, shared by the prefill, decode, PD and colocated services."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

from opentelemetry import trace

from libs.contract.epd.v1 import chat_pb2, generation_pb2
from libs.contract.validation import HELD_ITEMS_CAPABILITY
from libs.model import types as eng
from libs.runtime.prefill_runner import PrefillRunner, PrefillTask
from libs.serving.compute_thread import ComputeThread, DecodeLoop, StepStats
from libs.serving.convert import chunk_to_wire, engine_errors, messages_to_engine
from libs.serving.embeddings import FetchedItems, fetch_encoded
from libs.serving.transport import Transport
from libs.telemetry.stages import record_duration, record_prompt, stage, start_phase

T = TypeVar("T")
Streamed = tuple[generation_pb2.TokenChunk, generation_pb2.Usage | None]


def held_items_capability(runner: PrefillRunner) -> tuple[str, ...]:
    """`prefix.held_items` for a prefill whose prefix cache can stand in for embeddings."""
    return (HELD_ITEMS_CAPABILITY,) if runner.holds_items else ()


async def run_prefill(
    thread: ComputeThread,
    runner: PrefillRunner,
    messages: Sequence[chat_pb2.ChatMessage],
    sampling: eng.SamplingParams,
    fetched: FetchedItems,
    cache_salt: str = "",
) -> eng.PrefillResult:
    """Prefill on the compute thread; the fetched embedding slots go back once the engine is done
    with them - even when the caller is cancelled mid-prefill. `cache_salt`: the request's scope in
    the runner's prefix cache."""
    with stage("prefill.compute", "prefill"):
        engine_messages = messages_to_engine(messages, fetched.items)
        task = asyncio.ensure_future(_chunked(thread, runner, engine_messages, sampling, cache_salt))
        try:
            with engine_errors():
                result = await asyncio.shield(task)
        finally:
            if task.done():
                fetched.release()
            else:
                task.add_done_callback(lambda _: fetched.release())
        return result


async def _chunked(
    thread: ComputeThread,
    runner: PrefillRunner,
    messages: list[eng.ChatMessage],
    sampling: eng.SamplingParams,
    cache_salt: str,
) -> eng.PrefillResult:
    """Prefill in chunks of `runner.chunk_tokens`, each queued by its remaining prompt tokens: between
    two chunks of a long (multimodal) prompt the engine thread runs decode steps and shorter
    prefills (`ComputeThread`: shortest remaining first), so a text request does not wait for a whole
    long prefill, nor do streams stall for one."""
    busy = [0.0]  # seconds the engine thread spent on this prefill (for capacity planning)

    def timed(fn: Callable[..., T], *args: Any) -> T:
        started = time.perf_counter()
        try:
            return fn(*args)
        finally:
            busy[0] += time.perf_counter() - started

    task: PrefillTask = await thread.run(
        timed, functools.partial(runner.start, cache_salt=cache_salt), messages, sampling
    )
    chunks = 1
    while not await thread.run_at(task.remaining, timed, task.step, runner.chunk_tokens):
        chunks += 1
    result: eng.PrefillResult = await thread.run(timed, task.finish)
    state = result.decode_state
    record_prompt(
        trace.get_current_span(),
        prompt_tokens=state.prompt_tokens,
        cached_tokens=state.cached_prompt_tokens,
        reused_items=getattr(task, "reused_items", {}),
    )
    trace.get_current_span().set_attributes(
        {"epd.engine.busy_s": busy[0], "epd.prefill.chunks": chunks, "epd.prefill.chunk_tokens": runner.chunk_tokens}
    )
    return result


async def fetch_and_prefill(
    thread: ComputeThread,
    runner: PrefillRunner,
    transport: Transport,
    messages: Sequence[chat_pb2.ChatMessage],
    sampling: eng.SamplingParams,
    deadline: float | None,
    cache_salt: str = "",
) -> eng.PrefillResult:
    """Read a metadata-only request's embeddings from the encoders, then prefill."""
    specs = {spec.modality: spec for spec in runner.runtime.expected_specs()}
    fetched = await fetch_encoded(transport, messages, specs, deadline)
    return await run_prefill(thread, runner, messages, sampling, fetched, cache_salt)


async def stream_after_prefill(
    decode: DecodeLoop, request_id: str, result: eng.PrefillResult, sampling: eng.SamplingParams
) -> AsyncIterator[Streamed]:
    """The first chunk, then decode in this process; usage on the last chunk."""
    state = result.decode_state
    if result.kv_cache is None:
        usage = _usage(state, state.generated_tokens)
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
    steps = StepStats()
    try:
        with engine_errors():
            async for chunk in decode.stream(request_id, kv, state, sampling, steps):
                if first is None and chunk.token_ids:
                    first = time.perf_counter() - started
                generated += len(chunk.token_ids)
                usage = None
                if chunk.finish_reason is not None:
                    usage = _usage(state, generated)
                yield chunk_to_wire(chunk), usage
    finally:
        elapsed = time.perf_counter() - started
        tokens = generated - state.generated_tokens
        span.set_attributes(
            {
                "epd.decode.tokens": tokens,
                "epd.decode.first_token_s": first or 0.0,
                "epd.decode.inter_token_s": (elapsed - (first or 0.0)) / (tokens - 1) if tokens > 1 else 0.0,
                # Engine time per step and batch size: the planner fits a step's cost to its batch.
                "epd.decode.steps": steps.steps,
                "epd.decode.step_engine_s": steps.engine_s / steps.steps if steps.steps else 0.0,
                "epd.decode.batch_mean": steps.batch_sum / steps.steps if steps.steps else 0.0,
            }
        )
        span.end()
        record_duration("decode.generate", "decode", elapsed)


def _usage(state: eng.DecodeState, generated: int) -> generation_pb2.Usage:
    return generation_pb2.Usage(
        prompt_tokens=state.prompt_tokens,
        completion_tokens=generated,
        cached_prompt_tokens=state.cached_prompt_tokens,
    )
