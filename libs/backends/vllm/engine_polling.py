"""How vLLM's engine processes wait for each other.

EngineCore and its Worker pass every step through shared-memory queues (vLLM's
`shm_broadcast.MessageQueue`). A reader that finds nothing polls the queue with `sched_yield` for
`busy_loop_s` (1 s, fixed in vLLM 0.32) after its last read, and only then sleeps on a socket the
writer pings at every write. Under steady load both processes therefore poll while the other
computes. On a GPU host with spare cores that saves microseconds a step; on a small CPU host the
two pollers take the cores the forward, the service and the router need (docs/vllm.md).

Sleeping sooner needs one more change: the ping is a ZeroMQ PUB with a send high-water mark of 1,
so a ping sent while the previous one is still in flight is dropped. vLLM sleeps only after a
quiet second, when none is in flight; a reader that sleeps between steps can miss the ping of
the message it waits for and would sleep until vLLM's read timeout (seen: requests hung with the
window at 0). So a sleeping reader here wakes at least every `WAKE_MS` to look at the queue.

`install()` (one of the project's vLLM patches, patches.py: the plugin installs it in each of vLLM's
processes, EngineCore and the Worker among them) applies the service's `--engine-busy-poll-s`,
passed to the engine processes in `ENV`; without it vLLM's own behaviour stays.
"""

from __future__ import annotations

import functools
import os
from typing import Any

ENV = "EPD_ENGINE_BUSY_POLL_S"  # the setting's own variable: the engine processes inherit it
WAKE_MS = 1  # longest sleep of a reader between looks at its queue, in milliseconds
MARK = "_epd_busy_poll_s"  # carried by the project's wrapper (patches.py checks it)


def window_s() -> float | None:
    """The polling window the service asked for (`ENV`), seconds; None: vLLM's own."""
    value = os.environ.get(ENV)
    if value is None or float(value) < 0:
        return None
    return float(value)


def install() -> None:
    """Cap vLLM's reader polling window at `ENV`'s seconds, once per process."""
    window = window_s()
    if window is None:
        return
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    original = SpinCondition.wait
    if hasattr(original, MARK):
        return

    @functools.wraps(original)
    def wait(self: Any, timeout_ms: int | None = None) -> None:
        # vLLM sets the window per reader at construction; readers made before this ran too.
        self.busy_loop_s = min(self.busy_loop_s, window)
        original(self, WAKE_MS if timeout_ms is None else min(timeout_ms, WAKE_MS))

    setattr(wait, MARK, window)
    SpinCondition.wait = wait  # type: ignore[method-assign]
