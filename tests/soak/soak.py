"""Chaos soak: a supervised E/P/D stack (2 encoders, shared store) under steady mixed load while a
fault injector kills (SIGKILL and SIGTERM, alternately) an encoder, the prefill, the decode, the
router and the store master in turn, and the supervisor brings each back.

The soak is driven by its faults, not by a clock or a request count: each fault waits for a
settled stack (every role up) and a window of completed requests since the last recovery, then
kills its role and waits for the supervisor to report it ready again; the load stops once every
planned fault has been made and recovered and one more window has completed after the last. Time
and request count only bound it (a soak that hits either is reported incomplete, and fails).

Every request ends in one of three ways, counted apart:
- completed, with tokens equal to the reference run's (the same request sent before any fault);
- failed with a typed status from the stack (UNAVAILABLE while a stage was down mid-stream, ...);
- lost: a wrong answer, or none within the client's deadline. Lost must be 0.
At the end every pool and lease must be empty, and each service's resident memory is reported
(first sample after warm-up against the last) to show it stays flat.

    python -m tests.soak.soak --rounds 3 --time-limit-s 1800    # make soak (full)
tests/services/test_chaos_soak.py runs one round in `make test`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from libs.client.generate import build_request, generate, open_channel
from libs.contract.epd.v1 import generate_pb2, media_pb2, sampling_pb2
from libs.launch.stack import Stack, StackSpec
from libs.launch.supervisor import STORE_MASTER, Supervisor
from libs.model.media import synthetic

ROLES = ("encoder-0", "prefill", "decode", "router", STORE_MASTER, "encoder-1")


@dataclass
class SoakConfig:
    model: Path
    run_dir: Path
    faults: tuple[str, ...] = ROLES  # killed in this order, once per round
    rounds: int = 1
    # Requests completed (right tokens) on a settled stack before each fault and after the last
    # recovery: the window each fault's effect is measured against.
    window_requests: int = 20
    time_limit_s: float = 600.0  # bounds the load phase: faults not made and recovered by then fail the soak
    max_requests: int = 100_000  # bounds the load phase in count (a runaway guard, never the planned end)
    clients: int = 6
    recovery_timeout_s: float = 180.0  # one role's restart, as the supervisor reports it
    request_timeout_s: float = 90.0
    max_tokens: int = 8
    seed: int = 0


@dataclass
class SoakResult:
    sent: int = 0
    completed: int = 0
    failed: dict[str, int] = field(default_factory=dict)  # typed status -> count
    lost_wrong: int = 0
    lost_no_answer: int = 0
    kills: list[str] = field(default_factory=list)
    # One per fault made: role, signal, requests completed in the window before it, seconds until
    # the supervisor reported the role ready again (None: not recovered).
    windows: list[dict[str, object]] = field(default_factory=list)
    # Empty when every planned fault was made and recovered and the last window completed;
    # otherwise what the soak was still waiting for when a bound ended it.
    incomplete: str = ""
    restarts: dict[str, int] = field(default_factory=dict)
    pools_empty: bool = False
    busy_pools: str = ""
    rss_mib: dict[str, tuple[float, float]] = field(default_factory=dict)  # role -> (after warm-up, end)
    duration_s: float = 0.0

    @property
    def lost(self) -> int:
        return self.lost_wrong + self.lost_no_answer


def workload(seed: int, max_tokens: int) -> list[generate_pb2.GenerateRequest]:
    """A fixed set of distinct requests: text, images (new and repeated), video, audio, mixes."""
    rng = random.Random(seed)
    sampling = sampling_pb2.SamplingParams(max_tokens=max_tokens)

    def media(kind: str, i: int) -> media_pb2.MediaItem:
        if kind == "image":
            data = synthetic.png_bytes(rng.randint(24, 160), rng.randint(24, 160), seed=1000 + i)
            return media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=data)
        if kind == "video":
            data = synthetic.video_bytes(64, 32, frames=4, fps=2, seed=2000 + i)
            return media_pb2.MediaItem(modality=media_pb2.MODALITY_VIDEO, data=data)
        data = synthetic.wav_bytes(rng.choice([0.5, 1.0, 1.5]), seed=3000 + i)
        return media_pb2.MediaItem(modality=media_pb2.MODALITY_AUDIO, data=data)

    requests = [build_request(f"Say something about number {i}.", sampling=sampling) for i in range(4)]
    requests += [build_request("Describe the image.", [media("image", i)], sampling=sampling) for i in range(12)]
    requests += [build_request("What happens?", [media("video", i)], sampling=sampling) for i in range(3)]
    requests += [build_request("What is this sound?", [media("audio", i)], sampling=sampling) for i in range(3)]
    requests += [
        build_request("Compare them.", [media("audio", 10 + i), media("image", 100 + i)], sampling=sampling)
        for i in range(2)
    ]
    return requests


def _rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class _Memory:
    """RSS of each role's current process, sampled; the longest-lived incarnation is reported."""

    def __init__(self, stack: Stack, warmup_s: float) -> None:
        self._stack = stack
        self._warmup_s = warmup_s
        self._samples: dict[tuple[str, int], list[tuple[float, float]]] = {}

    def sample(self) -> None:
        for role, process in self._stack.processes.items():
            ready = process.ready_at
            if process.alive() and ready and time.monotonic() - ready >= self._warmup_s:
                rss = _rss_mib(process.pid)
                if rss is not None:
                    self._samples.setdefault((role, process.pid), []).append((time.monotonic(), rss))

    def report(self) -> dict[str, tuple[float, float]]:
        best: dict[str, list[tuple[float, float]]] = {}
        for (role, _), samples in self._samples.items():
            if role not in best or samples[-1][0] - samples[0][0] > best[role][-1][0] - best[role][0][0]:
                best[role] = samples
        return {role: (s[0][1], s[-1][1]) for role, s in sorted(best.items())}


def _kill(stack: Stack, role: str, sig: int) -> bool:
    if role == STORE_MASTER:
        proc = stack.store.master if stack.store is not None else None
        if proc is None or proc.poll() is not None:
            return False
        os.kill(proc.pid, sig)
        return True
    process = stack.processes.get(role)
    if process is None or not process.alive():
        return False
    os.kill(process.pid, sig)
    return True


async def _reference(address: str, requests: list[generate_pb2.GenerateRequest]) -> list[list[int]]:
    async with open_channel(address) as channel:
        return [(await generate(channel, r, timeout_s=120)).token_ids for r in requests]


def run_soak(config: SoakConfig, log: Path | None = None) -> SoakResult:
    spec = StackSpec(
        layout="e/p/d", encoders=2, model=config.model, run_dir=config.run_dir, cache_store=True, fixed_ports=True
    )
    stack = Stack(spec)
    result = SoakResult()
    events: list[str] = []

    def note(text: str) -> None:
        events.append(f"{time.strftime('%H:%M:%S')} {text}")
        if log is not None:
            print(events[-1], file=sys.stderr, flush=True)

    stack.up()
    supervisor = Supervisor(stack, on_event=lambda role, event: note(f"supervisor: {role} {event}")).start()
    try:
        requests = workload(config.seed, config.max_tokens)
        reference = asyncio.run(_reference(stack.address, requests))
        note(f"reference run: {len(requests)} requests")
        memory = _Memory(stack, warmup_s=15.0)
        stop_load = threading.Event()
        outcomes: Counter[str] = Counter()
        started = time.monotonic()

        def completed() -> int:
            return outcomes["completed"]

        def incomplete(why: str) -> None:
            if not result.incomplete:  # the first reason is the one that ended the soak
                result.incomplete = why

        def wait(condition: Callable[[], bool], deadline: float) -> bool:
            while not condition():
                if time.monotonic() > deadline or stop_load.is_set():
                    return False
                time.sleep(0.05)
            return True

        def window_done(since: int) -> Callable[[], bool]:
            return lambda: supervisor.settled() and completed() - since >= config.window_requests

        def ready_again(role: str, restarts: int) -> Callable[[], bool]:
            return lambda: supervisor.log.restarts(role) > restarts and supervisor.settled()

        def inject() -> None:
            """Each fault in turn, on a settled stack after a window of completed requests."""
            deadline = started + config.time_limit_s
            schedule = [role for _ in range(config.rounds) for role in config.faults]
            window_start = completed()
            for i, role in enumerate(schedule):
                if not wait(window_done(window_start), deadline):
                    incomplete(f"fault {i} ({role}): {completed() - window_start} requests in its window")
                    break
                sig = (signal.SIGKILL, signal.SIGTERM)[(i // len(config.faults) + i) % 2]
                restarts = supervisor.log.restarts(role)
                window: dict[str, object] = {"role": role, "signal": signal.Signals(sig).name}
                window["requests"] = completed() - window_start
                if not _kill(stack, role, sig):
                    incomplete(f"fault {i} ({role}): not running on a settled stack")
                    break
                killed_at = time.monotonic()
                result.kills.append(f"{role}:{signal.Signals(sig).name}")
                result.windows.append(window)
                note(f"fault: {role} {signal.Signals(sig).name} after {window['requests']} requests")
                if not wait(ready_again(role, restarts), min(deadline, killed_at + config.recovery_timeout_s)):
                    window["recovery_s"] = None
                    incomplete(f"fault {i} ({role}): not ready again")
                    break
                window["recovery_s"] = round(time.monotonic() - killed_at, 1)
                window_start = completed()
            else:
                if not wait(window_done(window_start), deadline):
                    incomplete(f"after the last fault: {completed() - window_start} requests")
            stop_load.set()

        async def load() -> None:
            rng = random.Random(config.seed + 1)
            async with open_channel(stack.address) as channel:

                async def client() -> None:
                    while (
                        not stop_load.is_set()
                        and result.sent < config.max_requests
                        and time.monotonic() - started < config.time_limit_s
                    ):
                        index = rng.randrange(len(requests))
                        result.sent += 1
                        try:
                            got = await generate(
                                channel, requests[index], timeout_s=config.request_timeout_s, retry_unavailable=True
                            )
                        except grpc.aio.AioRpcError as exc:
                            # grpc's own words when the client's deadline passed with no answer.
                            late = (
                                exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and exc.details() == "Deadline Exceeded"
                            )
                            outcomes["lost:no_answer" if late else f"failed:{exc.code().name}"] += 1
                            continue
                        outcomes["completed" if got.token_ids == reference[index] else "lost:wrong"] += 1

                async def sampler() -> None:
                    while not stop_load.is_set() and time.monotonic() - started < config.time_limit_s:
                        memory.sample()
                        await asyncio.sleep(2.0)

                clients = asyncio.gather(*(client() for _ in range(config.clients)))
                sampling = asyncio.ensure_future(sampler())
                await clients
                if not stop_load.is_set():  # the load's bounds came before the faults were done
                    incomplete(f"the load's bounds ended it first: {result.sent} requests")
                stop_load.set()
                await sampling

        injector = threading.Thread(target=inject, name="fault-injector")
        injector.start()
        try:
            asyncio.run(load())
        finally:
            stop_load.set()
            injector.join(60)
        result.duration_s = time.monotonic() - started
        note("load done; waiting for the supervisor to bring every role back")
        if not supervisor.wait_settled(180):
            note("supervisor did not settle within 180 s")
        memory.sample()
        result.completed = outcomes["completed"]
        result.failed = {k.split(":", 1)[1]: v for k, v in sorted(outcomes.items()) if k.startswith("failed:")}
        result.lost_wrong = outcomes["lost:wrong"]
        result.lost_no_answer = outcomes["lost:no_answer"]
        result.restarts = {role: supervisor.log.restarts(role) for role in config.faults}
        result.rss_mib = memory.report()
        result.pools_empty, result.busy_pools = _pools_empty(stack)
    finally:
        supervisor.stop()
        statuses = stack.down()
        note(f"stack down: {statuses}")
    if log is not None:
        settings = {**asdict(config), "model": str(config.model), "run_dir": str(config.run_dir)}
        log.write_text(json.dumps({"config": settings, "result": asdict(result), "events": events}, indent=1))
    return result


def _pools_empty(stack: Stack) -> tuple[bool, str]:
    from tests.support.stacks import wait_pools_empty

    try:
        wait_pools_empty(stack, timeout_s=60, allow_quarantine=True)
    except AssertionError as exc:
        return False, str(exc)[:2000]
    return True, ""


def render(result: SoakResult) -> str:
    failed = ", ".join(f"{code} {n}" for code, n in result.failed.items()) or "none"
    rss = "; ".join(f"{role} {a:.0f}->{b:.0f}" for role, (a, b) in result.rss_mib.items())
    windows = "; ".join(
        f"{w['role']} after {w['requests']} requests, back in {w.get('recovery_s')} s" for w in result.windows
    )
    return (
        f"sent {result.sent}, completed {result.completed}, failed {sum(result.failed.values())} ({failed}), "
        f"lost {result.lost} (wrong {result.lost_wrong}, no answer {result.lost_no_answer}) "
        f"in {result.duration_s:.0f} s\n"
        f"kills: {', '.join(result.kills)}\nrestarts: {result.restarts}\n"
        f"windows: {windows}\nincomplete: {result.incomplete or 'no'}\n"
        f"pools empty: {result.pools_empty} {result.busy_pools}\nRSS MiB (after warm-up -> end): {rss}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.soak.soak", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="times every role is killed, in turn")
    parser.add_argument("--window-requests", type=int, default=100, help="completed requests before each fault")
    parser.add_argument("--time-limit-s", type=float, default=1800.0, help="bound of the load phase")
    parser.add_argument("--max-requests", type=int, default=100_000, help="bound of the load phase in count")
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--run-dir", type=Path, default=Path("var/soak"))
    parser.add_argument("--out", type=Path, default=Path("var/soak/result.json"))
    ns = parser.parse_args()
    from libs.model.checkpoints import ensure_checkpoint

    config = SoakConfig(
        model=ensure_checkpoint("qwen2_5_omni", "tiny"),
        run_dir=ns.run_dir,
        rounds=ns.rounds,
        window_requests=ns.window_requests,
        time_limit_s=ns.time_limit_s,
        max_requests=ns.max_requests,
        clients=ns.clients,
    )
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    result = run_soak(config, log=ns.out)
    print(render(result))
    sys.exit(0 if result.lost == 0 and result.pools_empty and not result.incomplete else 1)


if __name__ == "__main__":
    main()
