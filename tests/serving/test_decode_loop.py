"""DecodeLoop's step accounting (what the capacity planner fits a decode step's cost to): each
sequence counts the steps it took part in, their engine time and their batch sizes."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from libs.model.types import FinishReason, TokenChunk
from libs.serving.compute_thread import ComputeThread, DecodeLoop, StepStats

pytestmark = pytest.mark.unit


class _Runner:
    """A decode runner whose sequences emit one token per step until their length, each step
    taking 1 ms per sequence in the batch."""

    def __init__(self) -> None:
        self.left: dict[str, int] = {}

    @property
    def active_ids(self) -> list[str]:
        return list(self.left)

    def add(self, request_id: str, kv: Any, state: Any, sampling: Any) -> None:
        self.left[request_id] = kv

    def cancel(self, request_id: str) -> None:
        self.left.pop(request_id, None)

    def step(self) -> dict[str, tuple[TokenChunk, None]]:
        time.sleep(0.001 * len(self.left))
        out = {}
        for request_id in list(self.left):
            self.left[request_id] -= 1
            done = self.left[request_id] == 0
            out[request_id] = (TokenChunk([1], "x", FinishReason.LENGTH if done else None), None)
            if done:
                del self.left[request_id]
        return out


def test_each_sequence_counts_its_steps_engine_time_and_batch_sizes() -> None:
    async def run() -> tuple[StepStats, StepStats]:
        engine = ComputeThread("test")
        loop = DecodeLoop(_Runner(), engine)  # type: ignore[arg-type]
        short, long = StepStats(), StepStats()

        async def drain(request_id: str, tokens: int, stats: StepStats) -> int:
            return len([c async for c in loop.stream(request_id, tokens, None, None, stats)])  # type: ignore[arg-type]

        try:
            # Whenever each joins the batch, they overlap for some steps and the long one runs its
            # last 2 steps alone: batch sums differ by exactly 2.
            counts = await asyncio.gather(drain("short", 3, short), drain("long", 5, long))
        finally:
            engine.shutdown()
        assert counts == [3, 5]
        return short, long

    short, long = asyncio.run(run())
    assert short.steps == 3 and long.steps == 5
    assert long.batch_sum - short.batch_sum == 2  # the long one's last 2 steps ran alone
    assert short.batch_sum <= 2 * short.steps
    assert long.engine_s > short.engine_s >= 0.001 * short.steps
