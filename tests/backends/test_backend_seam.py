"""The backend seam without a model: the registry by name (lazy, refusing what an engine lacks),
abort of one request, each service's core validating before its backend sees a request, and the
ServiceInfo and parts a service builds from whichever backend it was given."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from libs.backends import registry
from libs.backends.api import DecodeBackend, PrefillBackend, PrefillDecodeBackend
from libs.backends.engines import PAGED_KV, capability
from libs.backends.hosting.parts import backend_info, backend_parts
from libs.backends.in_flight import InFlight
from libs.contract.epd.v1 import (
    decode_pb2,
    generation_pb2,
    prefill_decode_pb2,
    prefill_pb2,
    service_info_pb2,
    stats_pb2,
)
from libs.contract.errors import InvalidArgument
from libs.contract.validation import RAW_PROMPT_CAPABILITY, SAMPLING_CAPABILITY
from libs.rpc.admission import CAPABILITY as ADMISSION_PRIORITY
from libs.rpc.admission import Admission
from libs.serving.settings import ModelServiceSettings
from services.decode.core import DecodeCore
from services.pd.core import PrefillDecodeCore
from services.prefill.core import PrefillCore
from tests.support import samples

pytestmark = pytest.mark.unit


def test_the_registry_names_one_module_per_role_and_engine() -> None:
    for role in registry.ROLES:
        assert registry.module_name(role, "reference") == f"libs.backends.reference.{role}"
    for role in ("encoder", "prefill", "decode", "pd"):
        assert registry.module_name(role, "vllm") == f"libs.backends.vllm.{role}"


@pytest.mark.parametrize("role", ["colocated"])
def test_the_registry_refuses_a_role_vllm_does_not_implement(role: str) -> None:
    with pytest.raises(
        ValueError, match=f"the vllm engine has no {role} backend; the {role} service runs on: reference"
    ):
        registry.module_name(role, "vllm")


def test_the_registry_refuses_unknown_names() -> None:
    with pytest.raises(ValueError, match="unknown engine 'tensorrt'"):
        registry.module_name("prefill", "tensorrt")
    with pytest.raises(ValueError, match="unknown role 'router'"):
        registry.module_name("router", "reference")


def test_abort_cancels_the_calls_in_flight_for_one_request() -> None:
    async def scenario() -> None:
        in_flight = InFlight()
        entered = asyncio.Event()

        async def call(request_id: str) -> str:
            with in_flight.track(request_id):
                entered.set()
                await asyncio.Event().wait()  # work that never ends on its own
            return "done"

        async def other() -> str:
            with in_flight.track("b"):
                await asyncio.sleep(0)
            return "finished"

        aborted = asyncio.ensure_future(call("a"))
        await entered.wait()
        assert len(in_flight) == 1
        assert not in_flight.cancel("b")  # nothing in flight under that id
        assert await other() == "finished"
        assert in_flight.cancel("a")
        with pytest.raises(asyncio.CancelledError):
            await aborted
        assert len(in_flight) == 0
        assert not in_flight.cancel("a")

    asyncio.run(scenario())


def test_abort_reaches_a_stream_in_its_consumers_task() -> None:
    async def scenario() -> None:
        in_flight = InFlight()

        async def stream() -> AsyncIterator[int]:
            with in_flight.track("s"):
                yield 1
                await asyncio.Event().wait()
                yield 2

        got: list[int] = []

        async def consume() -> None:
            async for item in stream():
                got.append(item)
                assert in_flight.cancel("s")

        with pytest.raises(asyncio.CancelledError):
            await consume()
        assert got == [1]
        assert len(in_flight) == 0

    asyncio.run(scenario())


class _Fake:
    """Records what reached it; answers with fixed wire messages."""

    name = "fake"
    weights_digest = "digest"
    max_running = 3

    def __init__(self) -> None:
        self.in_flight = InFlight()
        self.requests: list[Any] = []
        self.closed = False
        self.address = ""

    @property
    def active(self) -> int:
        return 2

    def capabilities(self) -> tuple[str, ...]:
        return (PAGED_KV, capability("vllm"))

    def serving_at(self, address: str) -> None:
        self.address = address

    async def close(self) -> None:
        self.closed = True


class FakePrefill(_Fake, PrefillBackend):
    async def prefill(self, request: prefill_pb2.PrefillRequest, deadline: float | None) -> prefill_pb2.PrefillResponse:
        self.requests.append(request)
        return prefill_pb2.PrefillResponse(first_chunk=generation_pb2.TokenChunk(token_ids=[7]))


class FakeDecode(_Fake, DecodeBackend):
    async def decode(
        self, request: decode_pb2.DecodeRequest, deadline: float | None
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        self.requests.append(request)
        yield decode_pb2.DecodeResponse(chunk=generation_pb2.TokenChunk(token_ids=[8]))


class FakePrefillDecode(_Fake, PrefillDecodeBackend):
    async def generate(
        self, request: prefill_decode_pb2.PrefillDecodeRequest, deadline: float | None
    ) -> AsyncIterator[prefill_decode_pb2.PrefillDecodeResponse]:
        self.requests.append(request)
        yield prefill_decode_pb2.PrefillDecodeResponse(chunk=generation_pb2.TokenChunk(token_ids=[9]))


def test_each_core_validates_before_its_backend_sees_the_request() -> None:
    async def scenario() -> None:
        prefill, decode, pd = FakePrefill(), FakeDecode(), FakePrefillDecode()
        with pytest.raises(InvalidArgument):
            await PrefillCore(prefill).prefill(prefill_pb2.PrefillRequest(), None)
        with pytest.raises(InvalidArgument):
            [r async for r in DecodeCore(decode).decode(decode_pb2.DecodeRequest(), None)]
        with pytest.raises(InvalidArgument):
            [r async for r in PrefillDecodeCore(pd).generate(prefill_decode_pb2.PrefillDecodeRequest(), None)]
        assert prefill.requests == decode.requests == pd.requests == []

        response = await PrefillCore(prefill).prefill(samples.prefill_request(), None)
        assert list(response.first_chunk.token_ids) == [7]
        chunks = [r.chunk.token_ids[0] async for r in DecodeCore(decode).decode(samples.decode_request(), None)]
        assert chunks == [8]
        streamed = [r async for r in PrefillDecodeCore(pd).generate(samples.prefill_decode_request(), None)]
        assert [r.chunk.token_ids[0] for r in streamed] == [9]
        assert len(prefill.requests) == len(decode.requests) == len(pd.requests) == 1

    asyncio.run(scenario())


def test_a_service_advertises_and_hosts_what_its_backend_reports() -> None:
    backend = FakePrefill()
    settings = ModelServiceSettings(model=Path("var/models/some-model"))
    info = backend_info(service_info_pb2.SERVICE_ROLE_PREFILL, settings, backend)
    assert list(info.capabilities) == [
        ADMISSION_PRIORITY,
        SAMPLING_CAPABILITY,
        RAW_PROMPT_CAPABILITY,
        PAGED_KV,
        capability("vllm"),
    ]
    # Contract 1.6's sampling fields are a generating stage's; an encoder does not advertise them.
    encoder = backend_info(service_info_pb2.SERVICE_ROLE_ENCODER, settings, backend)
    assert SAMPLING_CAPABILITY not in encoder.capabilities
    assert info.model.weights_digest == "digest"
    assert info.model.model_id == "some-model"

    async def scenario() -> None:
        admission = Admission("prefill", backend.max_running, 4)
        parts = backend_parts(
            (lambda servicer, server: None, object(), "epd.v1.PrefillService"), backend, admission=admission, info=info
        )
        assert parts.info() is info
        (_, stats, _) = parts.servicers[-1]
        response = await stats.GetStats(stats_pb2.GetStatsRequest(), None)
        assert response.active_sequences == 2
        assert parts.on_started is not None
        parts.on_started("127.0.0.1:5")
        assert backend.address == "127.0.0.1:5"
        assert parts.close is not None
        await parts.close()
        assert backend.closed

    asyncio.run(scenario())
