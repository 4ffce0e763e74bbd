"""Drain on SIGTERM in E/P/D on vLLM (real processes: a reference encoder, prefill and decode on
vLLM, the router), as tests/services/test_drain.py does for the reference engine; first, their
Prometheus metrics (the reference services' and vLLM's own).

The prefill gets SIGTERM while requests stream through the stack and while its engine holds KV
blocks under lease for handoffs nobody has read yet. Then: the streams finish with every token
(equal to their undisturbed run); new work is refused UNAVAILABLE "draining" (at the prefill
itself: whether the router waits for a replacement is the router's, tests/services/test_drain.py);
the prefill keeps the blocks, still counted as leases, until decode reads them, then exits 0.
The decode gets SIGTERM while it streams those handoffs: they finish with every token, new work
is refused, it exits 0. Nothing is left held anywhere."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from libs.contract.epd.v1 import (
    chat_pb2,
    decode_pb2,
    decode_pb2_grpc,
    generate_pb2_grpc,
    prefill_pb2,
    sampling_pb2,
    tensor_pb2,
)
from libs.launch.k8s import LANE_LABEL, OCCUPANCY_METRIC
from libs.launch.process import ServiceProcess, free_port
from libs.launch.stack import Stack, StackSpec
from libs.rpc.server import open_channel
from tests.support.metrics import sample_values, scrape
from tests.support.vllm_stack import (
    TokenStream,
    call,
    call_prefill,
    frozen_engine,
    handoff,
    mixes,
    probe_until_refused,
    request,
    run,
    stage_kinds,
    stats,
    until_draining,
    until_in_flight,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
MIXES = {mix.name: mix for mix in mixes("qwen2_5_omni")}
# Through the router when prefill gets its signal: each has its first token (prefill's), and decode's
# engine is stopped (frozen_engine), so none can go further, nor decode read their KV blocks, until
# the test thaws it after the signal and the probes, on a fast host as on a slow one.
STREAMED = ["audio", "image", "text"]
HANDOFFS = 2  # KV handoffs prefill holds for decode at its signal
TOKENS = 64  # each stream's and handoff's tokens, compared with their undisturbed runs
# The engines are stopped on purpose (frozen_engine) for as long as a loaded host needs: the
# watchdog must not take that for a hang (docs/vllm-operations.md).
GRACE = ["--grace-s", "240", "--engine-hang-timeout-s", "600"]
METRICS = {"prefill": free_port(), "decode": free_port()}  # their Prometheus ports


@pytest.fixture(scope="module")
def stack(omni_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """E/P/D on vLLM; prefill's leases outlive the test's steps (the handoffs wait for decode)."""
    spec = StackSpec(
        layout="e/p/d",
        encoders=1,
        model=omni_tiny,
        run_dir=tmp_path_factory.mktemp("vllm-drain"),
        engine="vllm",
        extra_args={
            "prefill": [*GRACE, "--lease-ttl-s", "300", "--metrics-port", str(METRICS["prefill"])],
            "decode": [*GRACE, "--metrics-port", str(METRICS["decode"])],
        },
        ready_timeout_s=600.0,
    )
    with Stack(spec).running() as running:
        yield running


def _prefill_request(n: int, max_tokens: int = TOKENS) -> prefill_pb2.PrefillRequest:
    return prefill_pb2.PrefillRequest(
        request_id=f"handoff-{n}-{time.monotonic_ns()}",
        messages=[
            chat_pb2.ChatMessage(
                role=chat_pb2.CHAT_ROLE_USER, parts=[chat_pb2.ContentPart(text=f"Tell story number {n}.")]
            )
        ],
        sampling=sampling_pb2.SamplingParams(max_tokens=max_tokens),
        accepted_kv_transports=[tensor_pb2.TRANSPORT_KIND_NIXL],
    )


async def _undisturbed_handoff(prefill: str, decode: str, n: int) -> list[int]:
    req = _prefill_request(n)
    first = await call_prefill(prefill, req)
    async with open_channel(decode) as channel:
        rest = TokenStream(decode_pb2_grpc.DecodeServiceStub(channel).Decode(handoff(req, first), timeout=120))
        return list(first.first_chunk.token_ids) + await rest.run()


def _signal(process: ServiceProcess) -> None:
    assert process.process is not None
    process.process.send_signal(signal.SIGTERM)


async def _prefill_drains(stack: Stack) -> dict[str, object]:
    """Streams through the router, decode's engine stopped; once each has its first token, SIGTERM
    the prefill and probe it; then thaw decode."""
    prefill = stack.processes["prefill"]
    # The undisturbed runs' KV leases acked (prefill notices a decode's read a moment after it):
    # only the unread handoffs' are left.
    for _ in range(300):  # bounded: 30 s
        if (await stats(prefill.address)).pool.active_leases == HANDOFFS:
            break
        await asyncio.sleep(0.1)
    async with open_channel(stack.address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        with frozen_engine(stack.processes["decode"]) as thaw:
            streams = [TokenStream(stub.Generate(request(MIXES[n], max_tokens=TOKENS), timeout=300)) for n in STREAMED]
            done = [asyncio.ensure_future(s.run()) for s in streams]
            await asyncio.wait_for(asyncio.gather(*(s.first.wait() for s in streams)), 120)
            _signal(prefill)
            at_signal = [len(s.tokens) for s in streams]
            await until_draining(prefill.address)
            probes = await probe_until_refused(
                lambda: call_prefill(prefill.address, _prefill_request(99, max_tokens=1))
            )
            # Their KV blocks as well as the handoffs', unread while decode's engine is stopped.
            held = (await stats(prefill.address)).pool.active_leases
            thaw()
            finished = await asyncio.gather(*done)
    # The streams are done, their KV leases released once decode's reads are acknowledged (which
    # lags the last token); the handoffs are not read yet: prefill must still hold exactly theirs.
    for _ in range(300):  # bounded: 30 s
        leases = (await stats(prefill.address)).pool.active_leases
        if leases == HANDOFFS:
            break
        await asyncio.sleep(0.1)
    return {"probes": probes, "finished": finished, "leases": leases, "at_signal": at_signal, "held": held}


async def _decode_drains(
    stack: Stack, reqs: list[prefill_pb2.PrefillRequest], handoffs: list[prefill_pb2.PrefillResponse]
) -> dict[str, object]:
    """Decode the held handoffs, its engine stopped; once it has admitted them, SIGTERM the decode
    and probe it; then thaw its engine: they stream during the drain."""
    decode = stack.processes["decode"]
    async with open_channel(decode.address) as channel:
        stub = decode_pb2_grpc.DecodeServiceStub(channel)
        with frozen_engine(decode) as thaw:
            streams = [
                TokenStream(stub.Decode(handoff(req, first), timeout=300))
                for req, first in zip(reqs, handoffs, strict=True)
            ]
            done = [asyncio.ensure_future(s.run()) for s in streams]
            await until_in_flight(decode.address, len(streams))
            _signal(decode)
            at_signal = (await stats(decode.address)).requests_in_flight
            await until_draining(decode.address)
            # Admission refuses before anything reads the request: an empty one is enough.
            empty = decode_pb2.DecodeRequest()
            probes = await probe_until_refused(lambda: TokenStream(stub.Decode(empty, timeout=30)).run())
            thaw()
            finished = await asyncio.gather(*done)
    return {"probes": probes, "finished": finished, "at_signal": at_signal}


def test_prefill_and_decode_export_the_reference_metrics_and_vllms(stack: Stack) -> None:
    assert len(call(stack.address, request(MIXES["image"])).token_ids) > 1  # an embedding read, a KV handoff
    want = {"prefill": {"queue", "prefill"}, "decode": {"queue", "transfer", "decode"}}
    moved = {"prefill": "encoder->prefill", "decode": "prefill->decode"}
    for role, port in METRICS.items():
        text = scrape(port)
        assert want[role] <= stage_kinds(text), (role, stage_kinds(text))
        assert sample_values(text, OCCUPANCY_METRIC, f'{LANE_LABEL}="{role}"') == [0.0], role  # idle
        assert sum(sample_values(text, "epd_transfer_bytes_total", f'"{moved[role]}"')) > 0, role
        assert len(sample_values(text, "vllm:kv_cache_usage_perc")) == 1, role
        assert sample_values(text, "vllm:num_requests_running") == [0.0], role


def _refused_draining(probes: object) -> None:
    assert isinstance(probes, list) and probes, probes
    *before, refused = probes
    assert refused.startswith("UNAVAILABLE: ") and "draining" in refused, probes
    assert all(p == "OK" or p.startswith("INVALID_ARGUMENT") for p in before), probes  # got in before the signal


@pytest.mark.timeout(900)
def test_prefill_then_decode_drain_with_streams_and_held_kv_blocks(stack: Stack) -> None:
    address = {name: p.address for name, p in stack.processes.items()}
    prefill, decode = stack.processes["prefill"], stack.processes["decode"]
    streamed = {n: call(stack.address, request(MIXES[n], max_tokens=TOKENS)).token_ids for n in STREAMED}
    handed = [run(_undisturbed_handoff, address["prefill"], address["decode"], n) for n in range(HANDOFFS)]
    assert all(len(tokens) == TOKENS for tokens in [*streamed.values(), *handed])

    reqs = [_prefill_request(n) for n in range(HANDOFFS)]
    handoffs = [run(call_prefill, address["prefill"], req) for req in reqs]  # blocks held for decode, under lease
    assert all(h.kv_cache.HasField("paged") for h in handoffs)

    first = asyncio.run(_prefill_drains(stack))
    assert first["at_signal"] == [1] * len(STREAMED)  # in flight at the signal: prefill's token only
    assert first["held"] == HANDOFFS + len(STREAMED)  # the streams' KV blocks, unread, in the drain too
    assert first["finished"] == [streamed[n] for n in STREAMED]  # every token, as undisturbed
    _refused_draining(first["probes"])
    assert first["leases"] == HANDOFFS  # the unread handoffs count in the drain
    assert prefill.alive(), prefill.log_tail()  # ... so it waits for them

    second = asyncio.run(_decode_drains(stack, reqs, handoffs))
    assert second["at_signal"] == HANDOFFS  # in flight at the signal (held by the stopped engine)
    # Prefill streamed each handoff's first token; decode streams the rest, every one of them.
    assert [list(h.first_chunk.token_ids) + t for h, t in zip(handoffs, second["finished"], strict=True)] == handed
    _refused_draining(second["probes"])
    assert prefill.process is not None and prefill.process.wait(120) == 0, prefill.log_tail()  # blocks read
    assert decode.process is not None and decode.process.wait(120) == 0, decode.log_tail()
    for name, process in (("prefill", prefill), ("decode", decode)):
        drained = [line for line in process.log_path.read_text().splitlines() if '"drained"' in line]
        assert drained and '"leases_still_held": 0' in drained[-1] and '"requests_finished": true' in drained[-1], name
    encoder = run(stats, address["encoder-0"])
    assert encoder.pool.slots_in_use == 0 and encoder.pool.active_leases == 0
