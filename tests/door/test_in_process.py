"""The door in the router's process (`libs/door/in_process.py`) without sockets: `Generate` straight
into the router core, in the router's admission, errors as the OpenAI errors their gRPC statuses
become, and a call left early that releases what the request held. tests/services/test_openai_door.py
runs the same door in a real router process against real services."""

from __future__ import annotations

import asyncio
import contextlib
import re
from pathlib import Path

import grpc
import httpx
import pytest
from prometheus_client import REGISTRY, generate_latest

from libs.contract.epd.v1 import generate_pb2, service_info_pb2
from libs.door.calls import GenerateCall
from libs.door.in_process import Listener, in_process, with_door
from libs.door.openai.errors import ApiError
from libs.door.server import DoorHttpSettings
from libs.rpc.admission import Admission
from libs.rpc.drain import drainer
from libs.rpc.main import ServiceParts
from tests.support.router_harness import Harness, image_request

pytestmark = pytest.mark.unit


def _door(h: Harness, admission: Admission | None = None) -> tuple[GenerateCall, Admission]:
    admission = admission or Admission("router", max_running=4, max_waiting=4)
    return in_process(h.router, admission, max_request_s=30.0), admission


async def _tokens(generate: GenerateCall, request: generate_pb2.GenerateRequest) -> list[int]:
    return [t async for response in generate(request, None) for t in response.chunk.token_ids]


def _refusal(generate: GenerateCall, request: generate_pb2.GenerateRequest) -> ApiError:
    with pytest.raises(ApiError) as caught:
        asyncio.run(_tokens(generate, request))
    return caught.value


def test_the_routers_answer_in_its_admission() -> None:
    h = Harness()
    generate, admission = _door(h)
    assert asyncio.run(_tokens(generate, image_request(2))) == [7, 8, 9]
    assert admission.running == 0
    assert h.leases.released == {}  # consumed to the end: nothing to release


def test_a_request_the_router_refuses_names_its_field() -> None:
    generate, _ = _door(Harness())
    error = _refusal(generate, generate_pb2.GenerateRequest())  # no messages
    assert (error.status, error.param, error.code) == (400, "epd.messages", "invalid_argument")


def test_media_an_encoder_refuses_names_its_item() -> None:
    """The field the door moves onto the client's own (`relocate`: the i-th media part's URL)."""
    failing = {f"enc{i}": grpc.StatusCode.INVALID_ARGUMENT for i in range(2)}
    generate, admission = _door(Harness(fail=failing))
    error = _refusal(generate, image_request(1))
    assert (error.status, error.param) == (400, "epd.media item 0"), error
    assert admission.running == 0


def test_a_full_or_draining_router_refuses_with_retry_after() -> None:
    h = Harness()
    full = Admission("router", max_running=1, max_waiting=0)
    full.running = 1  # every slot taken
    generate, _ = _door(h, full)
    busy = _refusal(generate, image_request(1))
    assert (busy.status, busy.code, busy.headers) == (429, "overloaded", {"Retry-After": "1"})
    draining = Admission("router", max_running=1, max_waiting=0)
    draining.close()
    generate, _ = _door(h, draining)
    gone = _refusal(generate, image_request(1))
    assert (gone.status, gone.code, gone.headers) == (503, "draining", {"Retry-After": "1"})


def test_a_call_left_early_frees_its_slot_and_leases() -> None:
    """The door closes the call when its client leaves: the router's `finally` releases the leases
    the request still holds, and the admission slot is given back."""
    h = Harness()
    generate, admission = _door(h)

    async def leave_mid_decode() -> list[int]:
        async with contextlib.aclosing(generate(image_request(2), None)) as stream:
            got = [t for _ in range(2) for t in (await anext(stream)).chunk.token_ids]  # prefill's, decode's first
            assert admission.running == 1
        return got

    assert asyncio.run(leave_mid_decode()) == [7, 8]
    assert admission.running == 0
    assert h.decode.calls[0].cancelled  # the decode stream it was reading was cancelled


def test_the_door_opens_beside_the_routers_server_and_closes_with_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`with_door`: the door listens once the router's server does (its own line), answers a chat
    completion from the router core, puts its instruments on the process's registry (the router's
    metrics port) while it is open, drains with the router's admission, and stops before the
    router's resources close."""
    h = Harness()
    admission = Admission("router", max_running=4, max_waiting=4)
    closed: list[str] = []

    async def close() -> None:
        closed.append("router")

    parts = ServiceParts(servicers=[], info=service_info_pb2.ServiceInfo, close=close, drain=drainer(admission))
    listener = Listener("127.0.0.1", 0, None, None, grace_s=1.0, max_request_s=30.0)
    served = with_door(parts, DoorHttpSettings(model=tmp_path / "omni"), listener, h.router, admission)

    async def scenario() -> None:
        assert served.after_listening is not None and served.drain is not None and served.close is not None
        await served.after_listening()
        line = re.search(r"^openai_door listening on (\S+)$", capsys.readouterr().out, re.MULTILINE)
        assert line is not None
        async with httpx.AsyncClient(base_url=f"http://{line.group(1)}", timeout=30) as client:
            assert (await client.get("/health")).json() == {"status": "serving"}
            reply = await client.post(
                "/v1/chat/completions", json={"model": "omni", "messages": [{"role": "user", "content": "hi"}]}
            )
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["completion_tokens"] == 3
            assert "epd_door_requests_total" in generate_latest(REGISTRY).decode()
            await served.drain(1.0)
            assert admission.closed
        await served.close()
        assert closed == ["router"]
        assert "epd_door_requests_total" not in generate_latest(REGISTRY).decode()

    asyncio.run(scenario())
