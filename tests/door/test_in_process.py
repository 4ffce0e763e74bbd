"""The router's OpenAI door (`services/router/openai.py`) without sockets: `Generate` straight into
the router core, in the router's admission, errors as the OpenAI errors their gRPC statuses become,
and a call left early that releases what the request held. tests/services/test_openai_door.py runs
the same door in a real router process against real services."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from libs.client.openai.errors import ApiError
from libs.contract.epd.v1 import generate_pb2
from libs.door.calls import GenerateCall
from libs.rpc.admission import Admission
from services.router.openai import in_process
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
