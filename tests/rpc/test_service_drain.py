"""A service process answers calls and drains on SIGTERM: the call in flight at the signal completes
and the process exits 0. Real process: `tests/support/slow_generate.py` under the same
`service_main` and `EpdServer` as every EPD service."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from libs.client.generate import build_request, generate, open_channel
from libs.launch.process import ServiceProcess
from tests.support.slow_generate import until_in_flight

pytestmark = pytest.mark.integration


def test_service_serves_and_drains_the_call_in_flight(tmp_path: Path) -> None:
    log = tmp_path / "slow.log"
    process = ServiceProcess("slow", "tests.support.slow_generate", ["--hold-until-drain", "--hold-s", "0.2"], log)
    process.start()
    try:
        address = process.wait_ready(60)

        async def drained_call() -> tuple[list[int], int | None]:
            async with open_channel(address) as channel:
                call = asyncio.create_task(generate(channel, build_request("hi", request_id="a"), timeout_s=30))
                # Admitted, and held until the drain begins: in flight at the signal on any host.
                await until_in_flight(address, 1)
                status = await asyncio.to_thread(process.stop, 30)
                return (await call).token_ids, status

        assert asyncio.run(drained_call()) == ([1], 0)
    finally:
        process.stop()
