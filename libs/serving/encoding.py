"""Running the encoder tower on the engine thread, traced as queue + preprocess + encode stages.

`encode_items` runs one call's items in one forward. `EncodeBatcher` (the encoder service's path)
also lets calls that arrive while the tower is busy share the next forward: under load a tower
forward over several images costs far less per image than one forward each (`make bench-encoder`). Nothing
waits to fill a batch: an idle encoder runs a lone call at once.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections import deque
from dataclasses import dataclass, field

from libs.model import types as eng
from libs.runtime.encoder_runner import EncoderRunner
from libs.serving.compute_thread import ComputeThread
from libs.serving.convert import engine_errors
from libs.telemetry.stages import record_stage


def _record(timings: dict[str, int], queued_ns: int, items: int, **attributes: int) -> None:
    """The call's stage spans, children of the caller's current span. The wait for the engine
    thread (behind other encodes) is a queue stage of its own, apart from the service's bookkeeping."""
    record_stage("encoder.engine_wait", "queue", queued_ns, timings["start"])
    record_stage("encoder.preprocess", "preprocess", timings["start"], timings["preprocessed"], items=items)
    record_stage("encoder.compute", "encode", timings["preprocessed"], timings["end"], items=items, **attributes)


async def encode_items(
    thread: ComputeThread, runner: EncoderRunner, media: list[eng.MediaInput], field_prefix: str = ""
) -> list[eng.EncodedItem]:
    """Encode on the compute thread; engine errors become contract errors."""
    timings: dict[str, int] = {}
    queued_ns = time.time_ns()
    with engine_errors(field_prefix):
        encoded = await thread.run(runner.encode, media, timings)
    _record(timings, queued_ns, len(media))
    return encoded


@dataclass
class _Call:
    media: list[eng.MediaInput]
    future: asyncio.Future[tuple[list[eng.EncodedItem], dict[str, int], int]]
    queued_ns: int = field(default_factory=time.time_ns)


class EncodeBatcher:
    """Encode calls on one compute thread, those that queued meanwhile together (use from one
    event loop).

    A call joins the queue; one drain task runs the queue's head batch on the thread - calls that
    `EncoderRunner.merges_exactly` (images: the same bits as alone), up to `max_items` items, in
    arrival order; any other call alone - then the next, until the queue is empty. A call's bad
    input fails that call only (`EncoderRunner.encode_calls`); a call whose caller gave up
    (cancelled, deadline) before its batch ran is skipped.
    """

    def __init__(self, thread: ComputeThread, runner: EncoderRunner, *, max_items: int) -> None:
        if max_items < 1:
            raise ValueError("max_items must be >= 1")
        self.thread = thread
        self.runner = runner
        self.max_items = max_items
        self._queue: deque[_Call] = deque()
        self._drain_task: asyncio.Task[None] | None = None

    async def encode(self, media: list[eng.MediaInput], field_prefix: str = "") -> list[eng.EncodedItem]:
        """`encode_items`' result for `media`, possibly computed in one forward with other calls."""
        call = _Call(media, asyncio.get_running_loop().create_future())
        self._queue.append(call)
        if self._drain_task is None or self._drain_task.done():
            # Its own context: the drain outlives the caller that started it, and holds none of its spans.
            self._drain_task = asyncio.create_task(self._drain(), name="encode-batches", context=contextvars.Context())
        with engine_errors(field_prefix):
            encoded, timings, batch_items = await call.future
        _record(timings, call.queued_ns, len(media), **{"epd.encoder.batch_items": batch_items})
        return encoded

    def _next_batch(self) -> list[_Call]:
        batch: list[_Call] = []
        items = 0
        while self._queue:
            call = self._queue[0]
            if call.future.done():  # its caller gave up while it waited
                self._queue.popleft()
                continue
            mergeable = EncoderRunner.merges_exactly(call.media)
            if batch and (not mergeable or items + len(call.media) > self.max_items):
                break
            batch.append(self._queue.popleft())
            items += len(call.media)
            if not mergeable:
                break
        return batch

    async def _drain(self) -> None:
        batch: list[_Call] = []
        try:
            while batch := self._next_batch():
                timings: dict[str, int] = {}
                outcomes = await self.thread.run(self.runner.encode_calls, [c.media for c in batch], timings)
                items = sum(len(c.media) for c in batch)
                for call, outcome in zip(batch, outcomes, strict=True):
                    if call.future.done():
                        continue
                    if isinstance(outcome, Exception):
                        call.future.set_exception(outcome)
                    else:
                        call.future.set_result((outcome, timings, items))
        except BaseException as exc:  # the thread shut down (or this task was cancelled): no results
            error = exc if isinstance(exc, Exception) else RuntimeError("encoder stopped")
            for call in [*batch, *self._queue]:
                if not call.future.done():
                    call.future.set_exception(error)
            self._queue.clear()
            if not isinstance(exc, Exception):
                raise
