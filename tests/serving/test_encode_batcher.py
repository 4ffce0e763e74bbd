"""The encoder's batcher: Encode calls that queue while the tower runs share its next forward
(images only, bounded in items, in arrival order); a bad call fails alone; a caller that gave up is
skipped; a stopped thread fails what waits instead of leaving it hanging. The runner here is a
recording fake (what the batcher hands it is the point); tests/runtime/test_encode_calls.py runs the
real runner's `encode_calls`, and every encoder stack test runs both together."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from libs.contract.errors import EpdError, InvalidArgument
from libs.model import types as eng
from libs.model.errors import InvalidMediaError
from libs.serving.compute_thread import ComputeThread
from libs.serving.encoding import EncodeBatcher
from tests.support.compute_thread import hold_thread, until_queued

pytestmark = pytest.mark.unit


class RecordingRunner:
    """`encode_calls` that records each batch; media whose bytes start with b"bad" fail their call."""

    def __init__(self) -> None:
        self.batches: list[list[list[bytes]]] = []

    def encode_calls(self, calls: list[list[eng.MediaInput]], timings: dict[str, int]) -> list[Any]:
        self.batches.append([[m.data for m in call] for call in calls])
        timings.update(start=1, preprocessed=2, end=3)
        return [
            InvalidMediaError("cannot decode image", field="media.data")
            if any(m.data.startswith(b"bad") for m in call)
            else [f"encoded:{m.data.decode()}" for m in call]
            for call in calls
        ]


def image(name: str) -> eng.MediaInput:
    return eng.MediaInput(eng.Modality.IMAGE, name.encode())


def video(name: str) -> eng.MediaInput:
    return eng.MediaInput(eng.Modality.VIDEO, name.encode())


async def _queued_behind_a_busy_thread(batcher: EncodeBatcher, calls: list[list[eng.MediaInput]]) -> list[Any]:
    """Submit `calls` while the thread is held by another job, then let it go; each call's result or error."""
    gate = threading.Event()
    blocker = await hold_thread(batcher.thread, gate)
    tasks = [asyncio.ensure_future(batcher.encode(call)) for call in calls]
    await asyncio.sleep(0)  # every call queued (each task's first step) before the thread is free
    gate.set()
    await blocker
    return list(await asyncio.gather(*tasks, return_exceptions=True))


def _run(max_items: int, scenario: Any) -> tuple[RecordingRunner, Any]:
    runner = RecordingRunner()
    thread = ComputeThread("test-encoder")
    try:
        batcher = EncodeBatcher(thread, runner, max_items=max_items)  # type: ignore[arg-type]
        return runner, asyncio.run(scenario(batcher))
    finally:
        thread.shutdown()


def test_calls_queued_while_the_tower_runs_share_one_forward_in_order() -> None:
    calls = [[image("a")], [image("b"), image("c")], [image("d")]]
    runner, results = _run(16, lambda b: _queued_behind_a_busy_thread(b, calls))
    assert runner.batches == [[[b"a"], [b"b", b"c"], [b"d"]]]
    assert results == [["encoded:a"], ["encoded:b", "encoded:c"], ["encoded:d"]]


def test_a_lone_call_runs_at_once() -> None:
    async def scenario(batcher: EncodeBatcher) -> list[Any]:
        first = await batcher.encode([image("a")])
        second = await batcher.encode([image("b")])
        return [first, second]

    runner, (first, second) = _run(16, scenario)
    assert runner.batches == [[[b"a"]], [[b"b"]]]
    assert (first, second) == (["encoded:a"], ["encoded:b"])


def test_one_requests_items_sent_together_to_an_idle_thread_share_one_forward() -> None:
    """How the reference encoder runs an Encode call's items: a batcher call each, all in one tick
    (one forward), each error naming its item's position in the Encode call."""

    async def scenario(batcher: EncodeBatcher) -> list[Any]:
        names = ["a", "bad-bytes", "c"]
        calls = (batcher.encode([image(n)], field_prefix=f"items[{i}]") for i, n in enumerate(names))
        return list(await asyncio.gather(*calls, return_exceptions=True))

    runner, results = _run(16, scenario)
    assert runner.batches == [[[b"a"], [b"bad-bytes"], [b"c"]]]
    assert results[0] == ["encoded:a"] and results[2] == ["encoded:c"]
    assert isinstance(results[1], InvalidArgument) and results[1].field == "items[1].media.data"


def test_videos_and_audio_run_alone_and_batches_keep_their_item_bound() -> None:
    calls = [[image("a")], [video("v")], [image("b"), image("c")], [image("d")], [image("e"), image("f")]]
    runner, results = _run(3, lambda b: _queued_behind_a_busy_thread(b, calls))
    assert runner.batches == [
        [[b"a"]],
        [[b"v"]],
        [[b"b", b"c"], [b"d"]],  # 3 items: the next call's 2 would pass the bound
        [[b"e", b"f"]],
    ]
    assert results[1] == ["encoded:v"] and results[4] == ["encoded:e", "encoded:f"]


def test_a_bad_call_fails_alone_with_its_own_typed_error() -> None:
    calls = [[image("a")], [image("ok"), image("bad-bytes")], [image("b")]]
    runner, results = _run(16, lambda b: _queued_behind_a_busy_thread(b, calls))
    assert len(runner.batches) == 1
    assert results[0] == ["encoded:a"] and results[2] == ["encoded:b"]
    error = results[1]
    assert isinstance(error, EpdError)
    assert error.code.name == "INVALID_ARGUMENT" and "media.data" in str(error), error


def test_a_call_whose_caller_gave_up_is_not_computed() -> None:
    async def scenario(batcher: EncodeBatcher) -> list[Any]:
        gate = threading.Event()
        blocker = await hold_thread(batcher.thread, gate)
        kept = asyncio.ensure_future(batcher.encode([image("kept")]))
        dropped = asyncio.ensure_future(batcher.encode([image("dropped")]))
        await asyncio.sleep(0)
        dropped.cancel()
        gate.set()
        await blocker
        return [await kept, dropped.cancelled()]

    runner, (kept, cancelled) = _run(16, scenario)
    assert runner.batches == [[[b"kept"]]]
    assert kept == ["encoded:kept"] and cancelled


def test_calls_waiting_when_the_thread_stops_fail_instead_of_hanging() -> None:
    async def scenario(batcher: EncodeBatcher) -> list[Any]:
        gate = threading.Event()
        blocker = await hold_thread(batcher.thread, gate)
        waiting = [asyncio.ensure_future(batcher.encode([image(n)])) for n in "ab"]
        await until_queued(batcher.thread, 1)  # their batch waits behind the held job
        stopper = asyncio.ensure_future(asyncio.to_thread(batcher.thread.shutdown))  # cancels what has not started
        await until_queued(batcher.thread, 0)
        gate.set()
        await blocker
        await stopper
        return list(await asyncio.wait_for(asyncio.gather(*waiting, return_exceptions=True), 30))

    runner, results = _run(16, scenario)
    assert runner.batches == []
    assert all(isinstance(r, BaseException) for r in results), results


def test_max_items_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_items"):
        EncodeBatcher(None, None, max_items=0)  # type: ignore[arg-type]
