"""A vLLM engine's life in a real PD service (text requests need no encoder): a hung engine is
detected, killed and restarted (health NOT_SERVING, then SERVING; its request fails UNAVAILABLE
with reason ENGINE_RESTARTING; a request after recovery succeeds); a failure past the restart
bound ends the service non-zero; a start past `engine_start_timeout_s` ends the start's processes
and, with no restart allowed, the service. The unit tests of the same logic (a stand-in engine,
the backoff on a fake clock) are in test_supervisor.py; a killed engine restarted within the
bound is test_vllm_pd.py's engine-kill test.

The hang is the engine's processes stopped (SIGSTOP, `frozen_engine`): the worker stops stepping,
EngineCore answers nothing, and the service's process runs on. No test-only hook is in the
service: the watchdog sees what it would see of any hang. The module's tests run in order: the
hang (restart 1 of 1 allowed), then the kill (one failure too many: the service ends)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from libs.contract.epd.v1 import chat_pb2, prefill_decode_pb2, prefill_decode_pb2_grpc, sampling_pb2
from libs.contract.reasons import Reason, reason_of
from libs.launch.process import ServiceProcess
from libs.rpc.server import open_channel
from tests.support.vllm_stack import (
    TokenStream,
    engine_processes,
    frozen_engine,
    stats,
    until_health,
    until_in_flight,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
HANG_S = 3.0  # the watchdog's timeout in this module: a stopped engine is given up this soon
LIFE = ["--engine-hang-timeout-s", str(HANG_S), "--engine-max-restarts", "1", "--engine-restart-window-s", "3600"]
LIFE += ["--engine-backoff-start-s", "0.5", "--engine-backoff-max-s", "1"]
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def _service(name: str, model: Path, log_dir: Path, extra: list[str]) -> ServiceProcess:
    args = ["--engine", "vllm", "--model", str(model), "--grace-s", "5", *extra]
    return ServiceProcess(name, "services.pd", args, log_path=log_dir / f"{name}.log")


@pytest.fixture(scope="module")
def pd(omni_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    process = _service("pd", omni_tiny, tmp_path_factory.mktemp("vllm-life"), LIFE)
    process.start()
    try:
        process.wait_ready(420)
        yield process
    finally:
        process.stop(60)


def _request(name: str, max_tokens: int) -> prefill_decode_pb2.PrefillDecodeRequest:
    return prefill_decode_pb2.PrefillDecodeRequest(
        request_id=f"{name}-{time.monotonic_ns()}",
        messages=[chat_pb2.ChatMessage(role=chat_pb2.CHAT_ROLE_USER, parts=[chat_pb2.ContentPart(text="Say hi.")])],
        sampling=sampling_pb2.SamplingParams(max_tokens=max_tokens),
    )


def test_a_hung_engine_is_restarted_and_its_request_fails_engine_restarting(pd: ServiceProcess) -> None:
    async def scenario() -> None:
        async with open_channel(pd.address) as channel:
            stub = prefill_decode_pb2_grpc.PrefillDecodeServiceStub(channel)
            with frozen_engine(pd):  # the worker stops stepping; the service runs on
                started = time.monotonic()
                stream = TokenStream(stub.PrefillDecode(_request("hung", 8), timeout=120))
                running = asyncio.ensure_future(stream.run())
                await until_in_flight(pd.address, 1)  # queued in the stopped engine: no output can come
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await running
                detected = time.monotonic() - started
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value.details()
            assert reason_of(failed.value) == Reason.ENGINE_RESTARTING
            assert "hung" in (failed.value.details() or "")
            assert HANG_S <= detected < HANG_S + 60  # the watchdog's timeout, not the request's deadline
            # Down while the replacement starts (refused at once, UNAVAILABLE), then back.
            assert (await until_health(pd.address, SERVING, 300))[0] == NOT_SERVING
            tokens = await TokenStream(stub.PrefillDecode(_request("after", 4), timeout=120)).run()
            assert len(tokens) == 4
            assert (await stats(pd.address)).requests_in_flight == 0

    asyncio.run(scenario())
    log = pd.log_tail(400)
    assert "hung: no progress for" in log and "vLLM engine restarted" in log, log


def test_a_failure_past_the_restart_bound_ends_the_service(pd: ServiceProcess) -> None:
    """The second failure within the window with one restart allowed: the engine is killed (its
    EngineCore's PID), the service stops and exits non-zero, naming the bound."""
    for core in [p for p in engine_processes(pd) if "EngineCore" in p.name() + " ".join(p.cmdline())]:
        core.send_signal(signal.SIGKILL)
    assert pd.process is not None
    status = pd.process.wait(120)
    log = pd.log_tail(60)
    assert status == 1, log
    assert "failed again after 1 restart(s) within 3600 s (engine_max_restarts, engine_restart_window_s)" in log, log
    assert "last failure: died" in log, log


def test_a_start_past_its_timeout_ends_its_processes_and_the_service(
    omni_tiny: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """No engine starts in 1 s here: the start's processes are killed, and with no restart
    allowed the service exits non-zero before it ever listens, leaving no process behind."""
    args = ["--engine-start-timeout-s", "1", "--engine-max-restarts", "0"]
    process = _service("pd-slow", omni_tiny, tmp_path_factory.mktemp("vllm-start"), args)
    process.start()
    try:
        assert process.process is not None
        status = process.process.wait(300)
        log = process.log_tail(60)
        assert status == 1, log
        assert "vLLM engine did not start within 1 s (engine_start_timeout_s); its processes" in log, log
        assert "listening on" not in log
        deadline = time.monotonic() + 30  # orphans of the group (none expected) would show here
        while True:
            try:
                os.killpg(process.pid, 0)
            except ProcessLookupError:
                break  # nothing of the service's process group is left
            assert time.monotonic() < deadline, "processes of the service's group outlived it"
            time.sleep(0.1)
    finally:
        process.stop(10)
