"""The router's recovery paths against real services, each at a precise moment: a router of our own
reaches the session stack's prefill and decode (or PD) through an interposer (a real gRPC server in
this process, tests/support/interposer.py) that acts on a request before forwarding it.

- An embedding gone or damaged between encode and prefill (its lease released at the encoder, its
  handle past its expiry, or bytes that no longer match the handle's checksum): the real prefill /
  PD fails the request with NOT_FOUND / DATA_LOSS, the router re-encodes before any token was
  streamed, and the client gets the model's own tokens.
- The KV cache gone before decode reads it (its lease expired while the router waited out a decode
  restart): the real decode fails the request with NOT_FOUND, the router recomputes (encode,
  prefill) and continues with decode without repeating the first token.
- A request that goes away (client cancel, deadline) before decode (or PD) reads what it holds:
  the router gives back the KV cache's lease at prefill (the embeddings' leases at the encoders).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from libs.client.generate import build_request, open_channel
from libs.contract.epd.v1 import generate_pb2, generate_pb2_grpc, sampling_pb2
from libs.launch.process import ServiceProcess
from libs.launch.stack import Stack
from libs.telemetry.spans import OtlpReceiver
from tests.support.golden import request_for
from tests.support.interposer import Interposer
from tests.support.stacks import MIXES, pool_stats, run_requests, wait_pools_empty
from tests.support.tracing import tracing_env

pytestmark = pytest.mark.stack

# Per layout: the stage the interposer fronts and its method.
STAGE = {"e/p/d": ("prefill", "Prefill"), "e+pd": ("pd", "PrefillDecode")}


@dataclass
class Front:
    """A router of our own over a session stack, with interposers in front of its stages."""

    stack: Stack
    router: ServiceProcess
    interposers: dict[str, Interposer]


@pytest.fixture(scope="module")
def fronts(
    stacks: Callable[[str], Stack], receiver: OtlpReceiver, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[str], Front]]:
    started: dict[str, Front] = {}

    def get(layout: str) -> Front:
        if layout in started:
            return started[layout]
        stack = stacks(layout)
        stages = ["prefill", "decode"] if layout == "e/p/d" else ["pd"]
        interposers = {name: Interposer(stack.processes[name].address) for name in stages}
        for interposer in interposers.values():
            interposer.start()
        encoders = ",".join(p.address for n, p in stack.processes.items() if n.startswith("encoder-"))
        args = ["--layout", layout, "--encoders", encoders]
        args += [a for name, i in interposers.items() for a in (f"--{name}", i.address)]
        log = tmp_path_factory.mktemp("front") / "router.log"
        router = ServiceProcess("router", "services.router", args, log_path=log, env=tracing_env(receiver))
        started[layout] = Front(stack, router, interposers)  # stopped at the end even if it fails to start
        router.start()
        router.wait_ready(60)
        return started[layout]

    yield get
    for front in started.values():
        assert front.router.stop() == 0
        for interposer in front.interposers.values():
            interposer.stop()


def _encoded_handles(request: Any) -> list[Any]:
    return [p.encoded.embeddings for m in request.messages for p in m.parts if p.WhichOneof("kind") == "encoded"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("layout", "how", "code"),
    [
        ("e/p/d", "released", "NOT_FOUND"),  # the slot was freed: its lease stamp is gone
        ("e/p/d", "expired", "NOT_FOUND"),  # the handle says its lease is over: refused before reading
        ("e/p/d", "corrupted", "DATA_LOSS"),  # the bytes read do not match the handle's CRC-32
        ("e+pd", "released", "NOT_FOUND"),
        ("e+pd", "corrupted", "DATA_LOSS"),
    ],
)
def test_embedding_gone_before_prefill_is_re_encoded(
    layout: str, how: str, code: str, fronts: Callable[[str], Front], expected: dict[str, list[int]]
) -> None:
    front = fronts(layout)
    stage, method = STAGE[layout]
    interposer = front.interposers[stage]
    leases: list[list[str]] = []  # the embedding leases each call carried

    async def gone_once(request: Any) -> None:
        handles = _encoded_handles(request)
        leases.append([h.lease_id for h in handles])
        if len(leases) > 1:
            return  # the retry goes through untouched
        if how == "corrupted":  # as if the bytes had changed since the encoder checksummed them
            for handle in handles:
                handle.tensors[0].checksum.value ^= 1
            return
        by_producer: dict[str, list[str]] = {}
        for handle in handles:
            by_producer.setdefault(handle.agent.producer_address, []).append(handle.lease_id)
        # What lease expiry does at the encoder: the slots are freed.
        assert await interposer.release_leases(by_producer) == len(handles)
        if how == "expired":  # ... and what the handle then says: its lease is over
            for handle in handles:
                handle.lease_expire_time.FromNanoseconds(time.time_ns() - 1_000_000_000)

    request = request_for(MIXES["two_images"], request_id=f"gone-{how}-{layout.replace('/', '').replace('+', '')}")
    interposer.hooks[method] = gone_once
    try:
        (result,) = run_requests(front.router.address, [request])
    finally:
        del interposer.hooks[method]
    assert result.token_ids == expected["two_images"]
    # The real stage refused the first call with the typed status, and the router re-encoded: the
    # second call carried new leases (new handles), and it went through.
    assert interposer.wait_outcomes(request.request_id, 2) == [code, "OK"]
    assert len(leases) == 2 and len(leases[0]) == len(leases[1]) == 2 and not set(leases[0]) & set(leases[1])
    wait_pools_empty(front.stack)


@pytest.mark.timeout(180)
def test_kv_gone_before_decode_reads_it_is_recomputed(
    fronts: Callable[[str], Front], expected: dict[str, list[int]]
) -> None:
    front = fronts("e/p/d")
    decode = front.interposers["decode"]
    kv_leases: list[str] = []

    async def kv_gone_once(request: Any) -> None:
        handle = request.kv_cache.handle
        kv_leases.append(handle.lease_id)
        if len(kv_leases) > 1:
            return
        # What the KV lease's expiry does at prefill (the slot is freed), and what the handle says.
        assert await decode.release_leases({handle.agent.producer_address: [handle.lease_id]}) == 1
        handle.lease_expire_time.FromNanoseconds(time.time_ns() - 1_000_000_000)

    request = request_for(MIXES["image"], request_id="kv-gone-recomputed")
    decode.hooks["Decode"] = kv_gone_once
    try:
        (result,) = run_requests(front.router.address, [request])
    finally:
        del decode.hooks["Decode"]
    # The model's own tokens, the first one streamed once, although prefill ran twice.
    assert result.token_ids == expected["image"]
    assert decode.wait_outcomes(request.request_id, 2) == ["NOT_FOUND", "OK"]
    assert front.interposers["prefill"].wait_outcomes(request.request_id, 2) == ["OK", "OK"]
    assert len(kv_leases) == 2 and kv_leases[0] != kv_leases[1]
    wait_pools_empty(front.stack)


async def _gone_while_held(
    address: str, request: generate_pb2.GenerateRequest, held: threading.Event, how: str
) -> tuple[int, grpc.StatusCode | None]:
    """Stream `request`; once the held call has reached the interposer, cancel (how == "cancel"),
    or let the deadline pass. Tokens received, and the final status (None: we cancelled)."""
    received = 0
    async with open_channel(address) as channel:
        call = generate_pb2_grpc.GenerateServiceStub(channel).Generate(request, timeout=60 if how == "cancel" else 8)
        waiting = asyncio.ensure_future(asyncio.to_thread(held.wait, 60))
        try:
            async for response in call:
                received += len(response.chunk.token_ids)
                if how == "cancel" and received:  # prefill's first token; now decode holds the rest
                    assert await waiting, "the call never reached the held stage"
                    call.cancel()
                    return received, None
        except grpc.aio.AioRpcError as exc:
            assert await waiting, "the call never reached the held stage"
            return received, exc.code()
    return received, grpc.StatusCode.OK


def _hold(held: threading.Event) -> Callable[[Any], Any]:
    async def hold(request: Any) -> None:
        held.set()
        await asyncio.Event().wait()  # never forwarded: the caller gives up first

    return hold


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_request_gone_before_decode_reads_the_kv_gives_the_kv_back(how: str, fronts: Callable[[str], Front]) -> None:
    front = fronts("e/p/d")
    decode = front.interposers["decode"]
    prefill = front.stack.processes["prefill"].address
    held = threading.Event()
    before = pool_stats(prefill).pool.released_leases
    request = build_request(
        "Count forever.", sampling=sampling_pb2.SamplingParams(max_tokens=64), request_id=f"kv-held-{how}"
    )
    decode.hooks["Decode"] = _hold(held)
    try:
        received, code = asyncio.run(_gone_while_held(front.router.address, request, held, how))
    finally:
        del decode.hooks["Decode"]
    # Prefill streamed the first token; decode had not read the KV cache when the request went away.
    assert received == 1
    assert code == (None if how == "cancel" else grpc.StatusCode.DEADLINE_EXCEEDED)
    assert decode.wait_outcomes(request.request_id, 1) == ["CANCELLED"]  # the router's call went too
    # The router released the KV cache's lease at prefill (else it would be held until its expiry).
    stats = wait_pools_empty(front.stack)
    assert stats["prefill"].pool.released_leases == before + 1


@pytest.mark.timeout(180)
def test_request_cancelled_before_pd_reads_the_embeddings_gives_them_back(fronts: Callable[[str], Front]) -> None:
    front = fronts("e+pd")
    pd = front.interposers["pd"]
    encoders = {n: p.address for n, p in front.stack.processes.items() if n.startswith("encoder-")}
    held = threading.Event()
    before = sum(pool_stats(a).pool.released_leases for a in encoders.values())
    request = request_for(MIXES["two_images"], request_id="embeddings-held")
    pd.hooks["PrefillDecode"] = _hold(held)
    try:

        async def cancel_when_held() -> None:
            async with open_channel(front.router.address) as channel:
                call = generate_pb2_grpc.GenerateServiceStub(channel).Generate(request, timeout=60)
                assert await asyncio.to_thread(held.wait, 60), "the call never reached PD"
                call.cancel()

        asyncio.run(cancel_when_held())
    finally:
        del pd.hooks["PrefillDecode"]
    assert pd.wait_outcomes(request.request_id, 1) == ["CANCELLED"]
    stats = wait_pools_empty(front.stack)
    # Both embeddings were encoded, never read, and given back by the router on the cancel.
    assert sum(stats[n].pool.released_leases for n in encoders) == before + 2
