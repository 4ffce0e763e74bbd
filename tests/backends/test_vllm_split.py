"""E/P/D on vLLM, every service its own process: a reference encoder, prefill and decode each on
vLLM's AsyncLLM, the router. Embeddings reach prefill's engine through the project's EC connector;
the KV moves prefill -> decode with vLLM's NixlConnector (the project's subclass, CPU buffers),
described on the wire by contract 1.3's typed fields (`KvCache.paged`, `DecodeState.engine_prompt`).

Tokens equal the reference runtime's; the handoff is typed and a lease of prefill's; a stale
handoff, a missing embedding, a cancel and killed engines give typed statuses, the services
recover and every pool ends empty. A contract 1.2 router (from the 1.2 release) serves the same
stack: the 1.3 fields pass through it. Runs last: the engine-kill test (engine restarts are slow, so it
is marked `bench`: `pytest -m bench tests/backends/test_vllm_split.py`)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2

from libs.contract.epd.v1 import (
    chat_pb2,
    decode_pb2,
    decode_pb2_grpc,
    layout_pb2,
    prefill_pb2,
    sampling_pb2,
    service_info_pb2,
    service_info_pb2_grpc,
    tensor_pb2,
)
from libs.contract.reasons import Reason, reason_of
from libs.launch.process import ServiceProcess, session_nice
from libs.launch.stack import Stack
from libs.model import types as eng
from libs.model.media import synthetic
from libs.rpc.server import open_channel
from tests.support.conversations import encoder_leases, turn
from tests.support.release_tree import release_checkout
from tests.support.stacks import run_requests
from tests.support.vllm_stack import (
    TOKENS,
    call,
    call_prefill,
    cancel_after_chunks,
    encode_image,
    handoff,
    health,
    mixes,
    reference_result,
    reference_tokens,
    release,
    request,
    run,
    sampled_tokens,
    stats,
)
from tests.support.vllm_unsplit import AGREEING_MIXES

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
MIXES = {mix.name: mix for mix in mixes("qwen2_5_omni")}
LONG = 4000  # tokens: up to the model length (4096), a stream that ends by the test (cancel, deadline)
RELEASE_1_2 = "Contract 1.2 and the router's cache short-circuit"


@pytest.fixture(scope="module")
def expected(omni_tiny: Path) -> dict[str, list[int]]:
    return {name: reference_tokens(omni_tiny, mix) for name, mix in MIXES.items()}


def _prefill_request(encoded: layout_pb2.EncodedMedia | None, max_tokens: int = 6) -> prefill_pb2.PrefillRequest:
    parts = [chat_pb2.ContentPart(encoded=encoded)] if encoded is not None else []
    parts.append(chat_pb2.ContentPart(text="Describe this."))
    return prefill_pb2.PrefillRequest(
        request_id=f"direct-{time.monotonic_ns()}",
        messages=[chat_pb2.ChatMessage(role=chat_pb2.CHAT_ROLE_USER, parts=parts)],
        sampling=sampling_pb2.SamplingParams(max_tokens=max_tokens),
        accepted_kv_transports=[tensor_pb2.TRANSPORT_KIND_NIXL],
    )


async def _decode(address: str, req: decode_pb2.DecodeRequest, timeout_s: float = 120) -> list[int]:
    async with open_channel(address) as channel:
        tokens: list[int] = []
        async for reply in decode_pb2_grpc.DecodeServiceStub(channel).Decode(req, timeout=timeout_s):
            tokens += reply.chunk.token_ids
        return tokens


def _status(coro_fn: Any, *args: Any) -> tuple[grpc.StatusCode, str]:
    try:
        run(coro_fn, *args)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def _addresses(stack: Stack) -> dict[str, str]:
    return {name: process.address for name, process in stack.processes.items()}


def _wait_empty(stack: Stack, timeout_s: float = 40.0) -> None:
    """No lease or slot held by an encoder, no KV handoff held by prefill's engine, no sequence in
    prefill or decode."""
    address = _addresses(stack)
    deadline = time.monotonic() + timeout_s
    while True:
        encoders = [run(stats, a) for n, a in address.items() if n.startswith("encoder")]
        prefill, decode = run(stats, address["prefill"]), run(stats, address["decode"])
        busy = {
            "encoders": sum(s.pool.slots_in_use + s.pool.active_leases for s in encoders),
            "prefill KV leases": prefill.pool.active_leases,
            "prefill sequences": prefill.active_sequences,
            "decode sequences": decode.active_sequences,
        }
        if not any(busy.values()):
            return
        assert time.monotonic() < deadline, f"still held: {busy}"
        time.sleep(0.25)


@pytest.mark.parametrize("mix", list(MIXES))
def test_tokens_equal_the_reference_runtime(vllm_split_stack: Stack, expected: dict[str, list[int]], mix: str) -> None:
    result = call(vllm_split_stack.address, request(MIXES[mix]))
    assert result.token_ids == expected[mix]
    assert result.completion_tokens == len(expected[mix])
    _wait_empty(vllm_split_stack)


@pytest.mark.parametrize("mix", sorted(AGREEING_MIXES & set(MIXES)))
def test_tokens_equal_vllms_own_unsplit_run(
    vllm_split_stack: Stack,
    omni_tiny: Path,
    vllm_unsplit: Callable[[Path, str], dict[str, list[int] | str]],
    mix: str,
) -> None:
    """vLLM alone, given the raw media (tests/support/vllm_unsplit.py), where its preprocessing is
    the project's: the same tokens."""
    result = call(vllm_split_stack.address, request(MIXES[mix]))
    assert result.token_ids == vllm_unsplit(omni_tiny, "qwen2_5_omni")[mix]


# Contract 1.6's sampling fields on vLLM's split (vLLM's own knobs): the reference runtime's tokens,
# across the P->D handoff (vLLM's decode re-runs the prompt and samples the first token again).
SAMPLING_1_6 = {
    "penalties": {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.25},
    "logprobs": {"logprobs": 3},
}


@pytest.mark.parametrize("mix", ["text", "image"])
@pytest.mark.parametrize("case", list(SAMPLING_1_6))
def test_contract_1_6_sampling_equals_the_reference_runtime(
    vllm_split_stack: Stack, omni_tiny: Path, expected: dict[str, list[int]], mix: str, case: str
) -> None:
    fields: dict[str, Any] = dict(SAMPLING_1_6[case])
    if case == "logprobs":  # with min_tokens holding a stop token id back past prefill's token
        greedy = expected[mix]
        at = next(i for i in range(2, len(greedy) - 2) if greedy[i] not in greedy[:i])
        fields.update(stop_token_ids=[greedy[at]], min_tokens=at + 2, ignore_eos=True)
    as_engine = {key: tuple(value) if isinstance(value, list) else value for key, value in fields.items()}
    want, want_logprobs = reference_result(omni_tiny, MIXES[mix], eng.SamplingParams(max_tokens=TOKENS, **as_engine))
    req: Any = request(MIXES[mix])
    for key, value in fields.items():
        if isinstance(value, list):
            getattr(req.sampling, key).extend(value)
        else:
            setattr(req.sampling, key, value)
    result = call(vllm_split_stack.address, req)
    _wait_empty(vllm_split_stack)  # decode acks prefill's lease after the stream ends: the next test counts leases
    assert result.token_ids == want
    if case == "penalties":
        assert want != expected[mix]  # the penalties change this answer
        assert not result.logprobs
        return
    assert len(result.logprobs) == len(want)  # one per token: decode dropped its copy of the first
    for ours, theirs in zip(want_logprobs, result.logprobs, strict=True):
        assert theirs.chosen.token_id == ours.chosen.token_id and theirs.chosen.token == ours.chosen.token
        assert theirs.chosen.logprob == pytest.approx(ours.chosen.logprob, abs=1e-3)
        assert [t.token_id for t in theirs.top] == [t.token_id for t in ours.top]
        assert [t.logprob for t in theirs.top] == pytest.approx([t.logprob for t in ours.top], abs=1e-3)


@pytest.mark.parametrize("mix", ["image", "video"])
def test_sampled_prompts_prefilled_in_chunks_hand_decode_the_token_it_draws(
    vllm_split_stack: Stack, expected: dict[str, list[int]], mix: str
) -> None:
    """Prefill's step budget is below every multimodal prompt (the stack's --max-num-batched-tokens):
    vLLM drops a token per chunk, and its rewind of the request's generator killed a CPU engine
    (libs/backends/vllm/seeded_sampling.py). Decode samples the first token again from the same
    seed, unchunked, and refuses a handoff whose token differs (DataLoss): prefill's chunked draw
    must be the unchunked one. Sampled without a seed (what `vllm bench serve` sends), the split
    seeds each request from its id."""
    address = vllm_split_stack.address
    first, again, other = (sampled_tokens(address, MIXES[mix], seed) for seed in (7, 7, 8))
    assert first == again
    assert other != first and first != expected[mix]
    assert sampled_tokens(address, MIXES[mix], None) != sampled_tokens(address, MIXES[mix], None)
    _wait_empty(vllm_split_stack)


def _cpus_of_threads(process: psutil.Process) -> set[frozenset[int]]:
    return {frozenset(os.sched_getaffinity(thread.id)) for thread in process.threads()}


def test_placed_the_decode_engine_runs_alone_and_every_other_process_on_the_services_cpus(
    vllm_split_stack: Stack,
) -> None:
    plan = vllm_split_stack.placement
    if plan is None:
        pytest.skip("one CPU: the stack is not placed")
    processes = {name: psutil.Process(p.pid) for name, p in vllm_split_stack.processes.items()}
    decode_engines = [p for p in processes["decode"].children(recursive=True) if "EngineCore" in p.name()]
    assert decode_engines, [p.name() for p in processes["decode"].children(recursive=True)]
    for engine in decode_engines:
        assert _cpus_of_threads(engine) == {plan.engine_cpus}
    # The prefill's engine stays with its service; the decode service's own threads keep theirs.
    for name in ("prefill", "decode", "router"):
        children = [] if name == "decode" else processes[name].children(recursive=True)
        for process in [processes[name], *children]:
            assert _cpus_of_threads(process) == {plan.service_cpus}, (name, process.name())
            assert process.nice() == 0
    assert _cpus_of_threads(processes["encoder-0"]) == {frozenset(os.sched_getaffinity(0))}
    assert processes["encoder-0"].nice() == plan.encoder_nice
    # ... its session too: across sessions the kernel's autogroups rank by the session's nice alone.
    assert session_nice(processes["encoder-0"].pid) in (None, plan.encoder_nice)


def test_a_conversations_next_turn_is_neither_encoded_nor_read_again(vllm_split_stack: Stack) -> None:
    """E/P/D on vLLM: the next turn of a conversation keeping its image goes to the prefill holding
    its prefix with the image as held (contract 1.9): no encoder call, a prefix hit past the image,
    the decode scoped to the tenant, the answer another tenant's cold turn gives."""
    address = vllm_split_stack.address
    (first,) = run_requests(address, [turn("tenant-a", None)])
    encoded = encoder_leases(vllm_split_stack)
    (again,) = run_requests(address, [turn("tenant-a", first.text)])
    assert encoder_leases(vllm_split_stack) == encoded, "the next turn was encoded though prefill held its image"
    (stranger,) = run_requests(address, [turn("tenant-b", first.text)])
    assert again.cached_prompt_tokens > first.prompt_tokens // 2 and stranger.cached_prompt_tokens == 0
    assert again.token_ids == stranger.token_ids
    _wait_empty(vllm_split_stack)


def test_prefill_and_decode_advertise_vllm_and_paged_kv(vllm_split_stack: Stack) -> None:
    async def info(address: str) -> service_info_pb2.ServiceInfo:
        async with open_channel(address) as channel:
            reply = await service_info_pb2_grpc.ServiceInfoServiceStub(channel).GetServiceInfo(
                service_info_pb2.GetServiceInfoRequest(), timeout=10
            )
            return reply.info

    address = _addresses(vllm_split_stack)
    for role in ("prefill", "decode"):
        got = run(info, address[role])
        assert {"engine.vllm", "kv.paged_blocks"} <= set(got.capabilities), role
        assert (got.contract_version.major, got.contract_version.minor) >= (1, 3)


def test_the_handoff_is_typed_and_a_lease_of_prefill(vllm_split_stack: Stack) -> None:
    address = _addresses(vllm_split_stack)
    encoded = run(encode_image, address["encoder-0"], synthetic.png_bytes(84, 56, seed=5))
    req = _prefill_request(encoded)
    first = run(call_prefill, address["prefill"], req)
    paged = first.kv_cache.paged
    assert not first.kv_cache.HasField("handle")
    assert paged.producer_address == address["prefill"] and paged.lease_id == paged.engine_request_id
    assert paged.engine_id.startswith("epd-prefill-") and paged.side_channel_host == "127.0.0.1"
    assert paged.transfer_mode == prefill_pb2.KV_TRANSFER_MODE_PULL and len(paged.groups) == 1
    assert paged.lease_expire_time.ToSeconds() > time.time()
    assert first.kv_cache.layout.num_tokens == first.decode_state.prompt_tokens
    prompt = first.decode_state.engine_prompt
    assert list(prompt.items) == [encoded.layout]  # the layout, no handle: decode reads no embedding
    assert len(prompt.token_ids) == first.decode_state.prompt_tokens - encoded.layout.placeholder_token_count + 1
    assert run(stats, address["prefill"]).pool.active_leases == 1  # held for decode
    rest = run(_decode, address["decode"], handoff(req, first))
    assert len(first.first_chunk.token_ids) + len(rest) == 6
    _wait_empty(vllm_split_stack)  # decode's read acked the lease: prefill freed the blocks
    assert run(stats, address["prefill"]).pool.acked_leases >= 1


def test_a_stale_handoff_is_refused_typed(vllm_split_stack: Stack, expected: dict[str, list[int]]) -> None:
    address = _addresses(vllm_split_stack)
    req = _prefill_request(None)
    first = run(call_prefill, address["prefill"], req)
    expired = handoff(req, first)
    expired.kv_cache.paged.lease_expire_time.FromSeconds(int(time.time()) - 1)
    code, details = _status(_decode, address["decode"], expired)
    assert code == grpc.StatusCode.NOT_FOUND and "expired" in details, (code, details)
    restarted = handoff(req, first)  # what a handoff from before a prefill restart names
    restarted.kv_cache.paged.engine_id = "epd-prefill-000000000000"
    code, details = _status(_decode, address["decode"], restarted)
    assert code == grpc.StatusCode.NOT_FOUND and "could not read the KV cache" in details, (code, details)
    assert run(release, address["prefill"], [first.kv_cache.paged.lease_id]) == 1  # what the router does
    _wait_empty(vllm_split_stack)
    assert run(health, address["decode"]) == health_pb2.HealthCheckResponse.SERVING
    assert call(vllm_split_stack.address, request(MIXES["text"])).token_ids == expected["text"]


def test_a_missing_embedding_fails_prefill_and_the_engine_lives(
    vllm_split_stack: Stack, expected: dict[str, list[int]]
) -> None:
    address = _addresses(vllm_split_stack)
    encoded = run(encode_image, address["encoder-0"], synthetic.png_bytes(56, 84, seed=9))
    run(release, address["encoder-0"], [encoded.embeddings.lease_id])  # freed (and poisoned): the READ must fail
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        run(call_prefill, address["prefill"], _prefill_request(encoded))
    code, details = caught.value.code(), caught.value.details() or ""
    assert code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DATA_LOSS, grpc.StatusCode.UNAVAILABLE), (code, details)
    # The reason the router re-encodes for; the details name the lease.
    assert reason_of(caught.value) == Reason.EMBEDDING_GONE and encoded.embeddings.lease_id in details
    assert run(health, address["prefill"]) == health_pb2.HealthCheckResponse.SERVING
    _wait_empty(vllm_split_stack)
    assert call(vllm_split_stack.address, request(MIXES["image"])).token_ids == expected["image"]


def test_cancel_mid_stream_frees_prefill_decode_and_the_leases(vllm_split_stack: Stack) -> None:
    # Up to the model's length: the stream is still running when the test cancels it, on any host.
    assert run(cancel_after_chunks, vllm_split_stack.address, request(MIXES["image"], max_tokens=LONG), 2) == 2
    _wait_empty(vllm_split_stack)


def test_a_deadline_mid_stream_ends_typed_and_frees_everything(vllm_split_stack: Stack) -> None:
    address = _addresses(vllm_split_stack)
    req = _prefill_request(None, max_tokens=LONG)  # the deadline comes first, on any host
    first = run(call_prefill, address["prefill"], req)
    code, details = _status(_decode, address["decode"], handoff(req, first), 0.5)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED, (code, details)
    _wait_empty(vllm_split_stack)  # vLLM aborted the sequence; the read (or the abort) freed prefill's blocks


@pytest.fixture(scope="module")
def release_1_2_tree(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A checkout of the commit that released contract 1.2 (its router speaks 1.2)."""
    with release_checkout(RELEASE_1_2, tmp_path_factory.mktemp("v1_2")) as path:
        yield path


def test_a_contract_1_2_router_passes_the_typed_handoff(
    vllm_split_stack: Stack, release_1_2_tree: Path, expected: dict[str, list[int]], tmp_path: Path
) -> None:
    address = _addresses(vllm_split_stack)
    args = ["--encoders", address["encoder-0"], "--prefill", address["prefill"], "--decode", address["decode"]]
    log = tmp_path / "router.log"
    router = ServiceProcess("router-1.2", "services.router", args, log_path=log, root=release_1_2_tree)
    router.start()
    try:
        router.wait_ready(120)
        for name in ("text", "image"):
            assert call(router.address, request(MIXES[name])).token_ids == expected[name], name
    finally:
        assert router.stop() == 0, router.log_tail()
    _wait_empty(vllm_split_stack)


@pytest.mark.bench  # ~2-3 min of engine restarts; the supervisor's kill path runs in test_vllm_pd.py
def test_killed_engines_fail_requests_unavailable_then_restart(
    vllm_split_stack: Stack, expected: dict[str, list[int]]
) -> None:
    services = {name: vllm_split_stack.processes[name] for name in ("prefill", "decode")}
    for name, process in services.items():
        children = psutil.Process(process.pid).children(recursive=True)
        cores = [p for p in children if "EngineCore" in p.name() + " ".join(p.cmdline())]
        assert cores, f"no EngineCore process under {name}"
        for core in cores:
            core.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 30
    code = grpc.StatusCode.OK
    while time.monotonic() < deadline and code != grpc.StatusCode.UNAVAILABLE:
        code = _status(call_prefill, services["prefill"].address, _prefill_request(None))[0]
    assert code == grpc.StatusCode.UNAVAILABLE
    for name, process in services.items():
        deadline = time.monotonic() + 60  # the supervisors poll their engines twice a second (bounded generously)
        while run(health, process.address) != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < deadline, f"{name}: health stayed SERVING with a dead engine"
            time.sleep(0.1)
    for name, process in services.items():
        deadline = time.monotonic() + 420
        while run(health, process.address) != health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline, f"{name}: the engine did not come back"
            time.sleep(1.0)
        assert process.alive()
    # Decode meets the new prefill engine (new engine id, new side channel) at its next handoff.
    assert call(vllm_split_stack.address, request(MIXES["audio"])).token_ids == expected["audio"]
    _wait_empty(vllm_split_stack)
