"""The service owns its vLLM engine's life: a bounded start, a watchdog, bounded restarts.

vLLM's `AsyncLLM` runs the model in spawned processes (EngineCore, and a Worker unless the worker
runs inside EngineCore: `runtime.executor_backend`). They can fail three
ways, and the supervisor treats each as a failure of the engine:

- **start**: the engine is not up within `engine_start_timeout_s` (or its start raises). Its
  processes (those spawned under this service while it started) are killed.
- **death**: a bad input that got past validation, a kill, an OOM. vLLM marks the engine
  `errored`; every request in flight fails with `EngineDeadError`.
- **hang**: work is queued (requests the service handed to the engine, or vLLM's own count of
  unfinished ones: a request can wait on the engine before vLLM counts it, e.g. on a first call's
  supported-tasks query) but the engine makes no progress
  for `engine_hang_timeout_s`: no request output arrives and a probe (an EngineCore utility call,
  answered only between steps, so only by a turning engine loop) gets no answer. A request
  waiting on something outside the engine (a remote KV read) is not a hang: the probe answers.
  The engine's processes are killed.

On a failure: health NOT_SERVING; new requests are refused UNAVAILABLE (`ENGINE_RESTARTING`); the
requests of the failed engine end at once with the same status (`Engine.next` races every output
against the engine being given up), so nothing waits on a dead engine and their streams unwind
through their own clean-up (leases released, failure reports removed). Then the engine is started
again after an exponential backoff (`engine_backoff_start_s`, doubling, at most
`engine_backoff_max_s`), SERVING once it is up. At most `engine_max_restarts` restarts within
`engine_restart_window_s`: one more failure ends the service with a clear error (exit non-zero),
so whatever supervises the process (Kubernetes, `epd up --supervise`) replaces it or a person
looks. A start that fails before the service ever served ends it the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import structlog

from libs.backends.settings import EngineSettings
from libs.contract.errors import DeadlineExceeded, Unavailable
from libs.contract.reasons import Reason

_log = structlog.get_logger(__name__)

HealthSetter = Callable[[bool], Awaitable[None]]
Fail = Callable[[str], None]
# A dead or killed engine's shutdown is bounded too (seconds): its processes are already gone.
_SHUTDOWN_S = 30.0
# How long killed processes get to be gone before the supervisor moves on (seconds).
_KILL_WAIT_S = 10.0


@dataclass(frozen=True)
class EngineLife:
    """The engine-life settings (libs/backends/settings.py, `EngineSettings`)."""

    start_timeout_s: float = 300.0
    hang_timeout_s: float = 30.0  # 0: no watchdog
    max_restarts: int = 5
    restart_window_s: float = 600.0
    backoff_start_s: float = 1.0
    backoff_max_s: float = 60.0

    @staticmethod
    def of(settings: EngineSettings) -> EngineLife:
        return EngineLife(
            start_timeout_s=settings.engine_start_timeout_s,
            hang_timeout_s=settings.engine_hang_timeout_s,
            max_restarts=settings.engine_max_restarts,
            restart_window_s=settings.engine_restart_window_s,
            backoff_start_s=settings.engine_backoff_start_s,
            backoff_max_s=settings.engine_backoff_max_s,
        )


class RestartPolicy:
    """Bounded restarts with exponential backoff, on the caller's clock (monotonic seconds).

    `next_delay(now)` is asked at each failure: the seconds to wait before the next start, or None
    when that start would be restart number `max_restarts + 1` within the last `restart_window_s`
    (give up). The delay doubles with each restart still inside the window, so an engine that
    failed once long ago restarts after `backoff_start_s` again."""

    def __init__(self, life: EngineLife) -> None:
        self._life = life
        self._restarts: deque[float] = deque()  # when each restart within the window was decided

    def recent(self, now: float) -> int:
        """Restarts within the window ending at `now`."""
        while self._restarts and now - self._restarts[0] >= self._life.restart_window_s:
            self._restarts.popleft()
        return len(self._restarts)

    def next_delay(self, now: float) -> float | None:
        count = self.recent(now)
        if count >= self._life.max_restarts:
            return None
        self._restarts.append(now)
        return float(min(self._life.backoff_max_s, self._life.backoff_start_s * 2.0**count))


class EngineStartFailed(RuntimeError):
    """One engine start failed or timed out (its processes were ended)."""


class EngineGaveUp(RuntimeError):
    """The engine failed more often than the restart bound allows: the service must end."""


def _restarting(detail: str) -> Unavailable:
    return Unavailable(f"vLLM engine {detail}; it is restarting, retry shortly", reason=Reason.ENGINE_RESTARTING)


class Engine:
    """One incarnation of the engine: the `AsyncLLM`, its processes, and whether it was given up."""

    def __init__(self, llm: Any, number: int, pids: tuple[int, ...], clock: Callable[[], float]) -> None:
        self.llm = llm
        self.number = number
        self.pids = pids  # EngineCore (and its Worker): what is killed when it hangs
        self._clock = clock
        self.last_progress = clock()  # an output or a probe answer (monotonic)
        self.busy = False  # work was queued at the watchdog's last look
        self.probe: asyncio.Task[None] | None = None
        self._lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.lost_reason = ""

    @property
    def lost(self) -> bool:
        return self._lost.done()

    def give_up(self, reason: str) -> None:
        if not self._lost.done():
            self.lost_reason = reason
            self._lost.set_result(None)
        if self.probe is not None:
            self.probe.cancel()

    async def next(self, stream: AsyncIterator[Any], deadline: float | None) -> Any:
        """The next output of a request's stream, within its deadline; UNAVAILABLE
        (ENGINE_RESTARTING) as soon as this engine is given up, whatever vLLM does with the stream."""
        if self.lost:
            raise _restarting(self.lost_reason)
        timeout = None if deadline is None else deadline - time.monotonic()
        if timeout is not None and timeout <= 0:
            raise DeadlineExceeded("deadline passed while generating")
        step = asyncio.ensure_future(anext(stream))
        try:
            done, _ = await asyncio.wait({step, self._lost}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            step.cancel()
            raise
        if step not in done:
            step.cancel()  # vLLM's generator aborts the request when cancelled
            if self.lost:
                raise _restarting(self.lost_reason)
            raise DeadlineExceeded("deadline passed while generating")
        try:
            out = step.result()
        except StopAsyncIteration:
            raise Unavailable("vLLM ended the request without a finish") from None
        self.last_progress = self._clock()
        return out


def _descendants() -> set[int]:
    """This process's descendants, less multiprocessing's resource tracker (shared by engines)."""
    import psutil

    out = set()
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "resource_tracker" not in " ".join(child.cmdline()):
                out.add(child.pid)
    return out


def _kill(pids: Iterable[int]) -> None:
    """SIGKILL `pids` and their descendants and wait (bounded) until they are gone; reaping is left
    to their parents (vLLM joins its EngineCore processes)."""
    import psutil

    victims: list[psutil.Process] = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(pid)
            victims += [process, *process.children(recursive=True)]
    for process in victims:
        with contextlib.suppress(psutil.Error):
            process.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + _KILL_WAIT_S
    for process in victims:
        while time.monotonic() < deadline:
            try:
                if process.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.Error:
                break
            time.sleep(0.02)


def _in_thread(fn: Callable[[], Any], name: str) -> asyncio.Future[Any]:
    """`fn()` on a daemon thread: an engine start or shutdown that never returns must neither block
    the event loop nor keep the process from exiting (asyncio.to_thread's threads are joined at exit)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def deliver(ok: bool, value: Any) -> None:
        if not future.done():
            (future.set_result if ok else future.set_exception)(value)

    def run() -> None:
        try:
            result = fn()
        except BaseException as exc:  # delivered to the awaiting task
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody awaits
                loop.call_soon_threadsafe(deliver, False, exc)
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(deliver, True, result)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


class EngineSupervisor:
    """Holds one live engine built by `build` (blocking; run on a thread) and replaces it when it
    fails (see the module's docstring). `queued` counts the service's requests in the engine;
    `clock`, `processes` and `kill` are seams for tests."""

    def __init__(
        self,
        build: Callable[[], Any],
        life: EngineLife | None = None,
        *,
        poll_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        processes: Callable[[], set[int]] = _descendants,
        kill: Callable[[Iterable[int]], None] = _kill,
        queued: Callable[[], int] = lambda: 0,
    ) -> None:
        self._build = build
        self._queued = queued  # the service's requests handed to the engine and not finished
        self.life = life or EngineLife()
        self._policy = RestartPolicy(self.life)
        self._poll_s = poll_s
        self._clock = clock
        self._processes = processes
        self._kill = kill
        self._engine: Engine | None = None
        self._health: HealthSetter | None = None
        self._fail: Fail | None = None
        self._watch: asyncio.Task[None] | None = None
        self._closing = False
        self.generation = 0  # incremented at every (re)start
        self.restarts = 0
        self.failures: list[str] = []  # why each engine was given up (stats, logs, tests)

    async def start(self) -> None:
        """The first engine (with restarts per the policy when it fails to start); EngineGaveUp
        past the bound."""
        self._engine = await self._start_until_up(None)
        self._watch = asyncio.create_task(self._watch_loop(), name="vllm-engine-watch")

    def watch_health(self, setter: HealthSetter) -> None:
        """Given by the server once it serves (libs/rpc/main.py)."""
        self._health = setter

    def watch_fatal(self, fail: Fail) -> None:
        """Given by the server once it serves: ends the service with an error (exit non-zero)."""
        self._fail = fail

    def engine(self) -> Engine:
        """The live engine, or UNAVAILABLE (ENGINE_RESTARTING) while there is none."""
        engine = self._engine
        if engine is None or engine.lost or engine.llm.errored:
            raise _restarting("is down after a failure")
        return engine

    def current(self) -> Any:
        """The live engine's `AsyncLLM` (UNAVAILABLE while it restarts)."""
        return self.engine().llm

    @property
    def alive(self) -> bool:
        engine = self._engine
        return engine is not None and not engine.lost and not engine.llm.errored

    async def _watch_loop(self) -> None:
        while not self._closing:
            await asyncio.sleep(self._poll_s)
            engine = self._engine
            if engine is None or self._closing:
                continue
            try:
                reason = self._failure(engine)
            except Exception:  # a watchdog that died silently would leave a hung engine in place
                _log.exception("vLLM engine watchdog: check failed")
                continue
            if reason is None:
                continue
            if not await self._recover(engine, reason):
                return

    def _failure(self, engine: Engine) -> str | None:
        """Why `engine` must be replaced, or None while it is fine."""
        if engine.llm.errored:
            return "died"
        hang_s = self.life.hang_timeout_s
        if hang_s <= 0:
            return None
        queued = max(self._queued(), int(engine.llm.get_num_unfinished_requests()))
        now = self._clock()
        if not queued:
            engine.busy = False
            return None
        if not engine.busy:  # work arrived: the engine owes progress from now on
            engine.busy = True
            engine.last_progress = max(engine.last_progress, now)
        stalled = now - engine.last_progress
        if stalled >= hang_s:
            return (
                f"hung: no progress for {stalled:.1f} s with {queued} request(s) queued "
                f"(engine_hang_timeout_s {hang_s:g})"
            )
        if stalled >= self._poll_s and (engine.probe is None or engine.probe.done()):
            engine.probe = asyncio.create_task(self._probe(engine), name="vllm-engine-probe")
        return None

    async def _probe(self, engine: Engine) -> None:
        """An EngineCore utility call: EngineCore answers it between steps, so an answer means the
        engine loop turns (a request may be waiting on something else, e.g. a remote KV read)."""
        with contextlib.suppress(Exception):
            await engine.llm.is_sleeping()
            engine.last_progress = self._clock()

    async def _recover(self, engine: Engine, reason: str) -> bool:
        """Replace a failed engine; False when the service must end (it was told)."""
        self.failures.append(reason)
        _log.error("vLLM engine failed; restarting", reason=reason, generation=engine.number)
        await self._set_health(False)
        self._engine = None
        engine.give_up(reason)  # its requests end now, UNAVAILABLE
        await self._end(engine, kill=True)
        try:
            replacement = await self._start_until_up(reason)
        except EngineGaveUp as exc:
            _log.error("vLLM engine: giving up; the service ends", error=str(exc))
            self._fatal(str(exc))
            return False
        if self._closing:
            await self._end(replacement, kill=False)
            return False
        self._engine = replacement
        self.restarts += 1
        _log.info("vLLM engine restarted", generation=self.generation)
        await self._set_health(True)
        return True

    async def _start_until_up(self, reason: str | None) -> Engine:
        """Start an engine; after a failure (`reason`), first wait the policy's backoff."""
        while True:
            if reason is not None:
                delay = self._policy.next_delay(self._clock())
                if delay is None:
                    raise EngineGaveUp(
                        f"vLLM engine failed again after {self.life.max_restarts} restart(s) within "
                        f"{self.life.restart_window_s:g} s (engine_max_restarts, engine_restart_window_s); "
                        f"last failure: {reason}"
                    )
                _log.warning("vLLM engine: starting again", in_s=delay, reason=reason)
                await asyncio.sleep(delay)
                if self._closing:
                    raise asyncio.CancelledError
            try:
                return await self._start_once()
            except EngineStartFailed as exc:
                reason = str(exc)
                self.failures.append(reason)
                _log.error("vLLM engine start failed", reason=reason)

    async def _start_once(self) -> Engine:
        """One engine start, bounded by `engine_start_timeout_s`: past it (or when the start
        raises) the processes it spawned are killed and EngineStartFailed raised."""
        before = await asyncio.to_thread(self._processes)
        abandoned = threading.Event()
        lock = threading.Lock()

        def build() -> Any:
            llm = self._build()
            with lock:
                late = abandoned.is_set()
            if late:  # nobody awaits it: do not leave it running
                _shutdown(llm)
                return None
            return llm

        started = self._clock()
        pending = _in_thread(build, "vllm-engine-start")
        timeout = self.life.start_timeout_s
        try:
            llm = await asyncio.wait_for(asyncio.shield(pending), timeout)
        except TimeoutError:
            with lock:
                abandoned.set()
            spawned = await self._end_start(pending, before)
            raise EngineStartFailed(
                f"vLLM engine did not start within {timeout:g} s (engine_start_timeout_s); "
                f"its processes {sorted(spawned)} were ended"
            ) from None
        except asyncio.CancelledError:  # closing while it starts
            with lock:
                abandoned.set()
            self._kill(self._processes() - before)
            raise
        except Exception as exc:
            spawned = await asyncio.to_thread(lambda: self._processes() - before)
            await asyncio.to_thread(self._kill, spawned)
            raise EngineStartFailed(f"vLLM engine start failed: {type(exc).__name__}: {exc}") from exc
        pids = await asyncio.to_thread(lambda: self._processes() - before)
        self.generation += 1
        seconds = round(self._clock() - started, 1)
        _log.info("vLLM engine started", generation=self.generation, seconds=seconds, pids=sorted(pids))
        return Engine(llm, self.generation, tuple(sorted(pids)), self._clock)

    async def _end_start(self, pending: asyncio.Future[Any], before: set[int]) -> set[int]:
        """Kill what a timed-out start spawned until the start returns: vLLM's start raises once
        its EngineCore is gone; one still short of spawning it is killed as soon as it does (an
        engine it still completes shuts itself down: `abandoned`). Bounded; the processes ended."""
        spawned: set[int] = set()
        give_up = self._clock() + _SHUTDOWN_S
        while True:
            new = await asyncio.to_thread(lambda: self._processes() - before)
            spawned |= new
            await asyncio.to_thread(self._kill, new)
            try:
                await asyncio.wait_for(asyncio.shield(pending), 1.0)
            except TimeoutError:
                if self._clock() < give_up:
                    continue
            except Exception:  # the start failed, as it should once its processes are gone
                pass
            break
        late = await asyncio.to_thread(lambda: self._processes() - before)
        await asyncio.to_thread(self._kill, late)
        return spawned | late

    async def _end(self, engine: Engine, *, kill: bool) -> None:
        """Stop an engine: killed first when it failed (a hung one would not stop; a dead
        EngineCore may leave its worker), then vLLM's shutdown, bounded either way."""
        if kill:
            await asyncio.to_thread(self._kill, engine.pids)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(_in_thread(lambda: _shutdown(engine.llm), "vllm-engine-stop"), _SHUTDOWN_S)

    def _fatal(self, message: str) -> None:
        if self._fail is not None:
            self._fail(message)
            return
        # No server to stop (not serving yet): nothing else can end the process cleanly.
        _log.critical("vLLM engine gave up and no server is attached; exiting", error=message)
        os._exit(1)

    async def _set_health(self, serving: bool) -> None:
        if self._health is not None:
            with contextlib.suppress(Exception):
                await self._health(serving)

    async def close(self) -> None:
        self._closing = True
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.give_up("stopped")
            await self._end(engine, kill=False)


async def start_or_exit(supervisor: EngineSupervisor, close: Callable[[], Awaitable[None]]) -> None:
    """A backend's first engine start: past the restart bound the service exits non-zero with the
    reason (it never served)."""
    try:
        await supervisor.start()
    except EngineGaveUp as exc:
        await close()
        raise SystemExit(f"epd: {exc}") from None


def _shutdown(llm: Any) -> None:
    with contextlib.suppress(Exception):
        llm.shutdown()
