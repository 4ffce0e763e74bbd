"""E+PD on vLLM, every service its own process: a reference encoder, the PD service running
vLLM's AsyncLLM (embeddings read over NIXL by the project's EC connector inside vLLM's worker),
the router. Tokens equal the reference runtime's; bad input, a missing embedding, a cancel and a
killed engine give typed statuses, the service recovers and every pool ends empty; SIGTERM drains
the PD service.

Run last within this module: the engine-kill test (a restart costs ~1 min), then the drain test
(it stops the PD service)."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2

from libs.client.generate import generate
from libs.client.generate import open_channel as client_channel
from libs.contract.epd.v1 import (
    chat_pb2,
    generate_pb2_grpc,
    layout_pb2,
    media_pb2,
    prefill_decode_pb2,
    prefill_decode_pb2_grpc,
    sampling_pb2,
    service_info_pb2,
    service_info_pb2_grpc,
    tensor_pb2,
)
from libs.contract.reasons import Reason, reason_of
from libs.launch.stack import Stack
from libs.model import types as eng
from libs.model.media import synthetic
from libs.rpc.server import open_channel
from tests.support.conversations import encoder_leases, turn
from tests.support.openai_door import disconnect_mid_stream, openai_messages, running_door, traceparent
from tests.support.stacks import run_requests
from tests.support.vllm_stack import (
    TOKENS,
    TokenStream,
    call,
    cancel_after_chunks,
    encode_image,
    frozen,
    frozen_engine,
    health,
    mixes,
    probe_until_refused,
    reference_result,
    reference_tokens,
    release,
    request,
    run,
    sampled_tokens,
    stats,
    until_draining,
    until_in_flight,
)
from tests.support.vllm_unsplit import AGREEING_MIXES

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
MIXES = {mix.name: mix for mix in mixes("qwen2_5_omni")}
LONG = 4000  # tokens: up to the model length (4096), a stream the test ends (cancels) itself


def _pd_request(encoded: layout_pb2.EncodedMedia | None, text: str = "Describe this.", max_tokens: int = 4) -> Any:
    parts = [chat_pb2.ContentPart(encoded=encoded)] if encoded is not None else []
    parts.append(chat_pb2.ContentPart(text=text))
    return prefill_decode_pb2.PrefillDecodeRequest(
        request_id=f"direct-{time.monotonic_ns()}",
        messages=[chat_pb2.ChatMessage(role=chat_pb2.CHAT_ROLE_USER, parts=parts)],
        sampling=sampling_pb2.SamplingParams(max_tokens=max_tokens),
    )


async def _prefill_decode(address: str, req: Any) -> list[int]:
    async with open_channel(address) as channel:
        tokens: list[int] = []
        async for reply in prefill_decode_pb2_grpc.PrefillDecodeServiceStub(channel).PrefillDecode(req, timeout=120):
            tokens += reply.chunk.token_ids
        return tokens


def _pd_status(address: str, req: Any) -> tuple[grpc.StatusCode, str]:
    try:
        run(_prefill_decode, address, req)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def _wait_empty(stack: Stack, timeout_s: float = 20.0) -> None:
    """Every encoder pool back to empty, no lease held, no sequence left in PD."""
    deadline = time.monotonic() + timeout_s
    while True:
        encoders = [run(stats, p.address) for n, p in stack.processes.items() if n.startswith("encoder")]
        pd = run(stats, stack.processes["pd"].address)
        busy = [s.pool.slots_in_use + s.pool.active_leases for s in encoders]
        busy += [pd.active_sequences, pd.pool.slots_in_use]  # PD's pool: the embeddings it read for vLLM
        if not any(busy):
            return
        assert time.monotonic() < deadline, f"still held: {busy}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def expected(omni_tiny: Path) -> dict[str, list[int]]:
    return {name: reference_tokens(omni_tiny, mix) for name, mix in MIXES.items()}


@pytest.mark.parametrize("mix", list(MIXES))
def test_tokens_equal_the_reference_runtime(vllm_epd_stack: Stack, expected: dict[str, list[int]], mix: str) -> None:
    result = call(vllm_epd_stack.address, request(MIXES[mix]))
    assert result.token_ids == expected[mix]
    assert result.completion_tokens == len(expected[mix])
    _wait_empty(vllm_epd_stack)


@pytest.mark.parametrize("mix", sorted(AGREEING_MIXES & set(MIXES)))
def test_tokens_equal_vllms_own_unsplit_run(
    vllm_epd_stack: Stack,
    omni_tiny: Path,
    vllm_unsplit: Callable[[Path, str], dict[str, list[int] | str]],
    mix: str,
) -> None:
    """vLLM alone, given the raw media (tests/support/vllm_unsplit.py), where its preprocessing is
    the project's: the same tokens."""
    result = call(vllm_epd_stack.address, request(MIXES[mix]))
    assert result.token_ids == vllm_unsplit(omni_tiny, "qwen2_5_omni")[mix]


def test_contract_1_6_sampling_equals_the_reference_runtime(vllm_epd_stack: Stack, omni_tiny: Path) -> None:
    """The penalties, min_tokens (holding a stop token id back), ignore_eos and logprobs in one
    request on vLLM's one engine: the reference runtime's tokens and log-probabilities."""
    greedy = reference_tokens(omni_tiny, MIXES["image"])
    at = next(i for i in range(2, len(greedy) - 2) if greedy[i] not in greedy[:i])
    fields: dict[str, Any] = {
        "repetition_penalty": 1.2,
        "frequency_penalty": 0.4,
        "presence_penalty": -0.2,
        "min_tokens": at + 2,
        "ignore_eos": True,
        "logprobs": 2,
    }
    want, want_logprobs = reference_result(
        omni_tiny,
        MIXES["image"],
        eng.SamplingParams(max_tokens=TOKENS, stop_token_ids=(greedy[at],), **fields),
    )
    req: Any = request(MIXES["image"])
    req.sampling.stop_token_ids.append(greedy[at])
    for key, value in fields.items():
        setattr(req.sampling, key, value)
    result = call(vllm_epd_stack.address, req)
    assert result.token_ids == want
    assert [e.chosen.token for e in result.logprobs] == [e.chosen.token for e in want_logprobs]
    for ours, theirs in zip(want_logprobs, result.logprobs, strict=True):
        assert [t.token_id for t in theirs.top] == [t.token_id for t in ours.top]
        assert theirs.chosen.logprob == pytest.approx(ours.chosen.logprob, abs=1e-3)
    _wait_empty(vllm_epd_stack)


def test_requests_served_together_prefill_in_chunks_and_equal_the_reference(
    vllm_epd_stack: Stack, expected: dict[str, list[int]]
) -> None:
    """Every mix at once, twice over: vLLM caps each prompt at 16 tokens a step while the others
    run or wait (the stack's --prefill-chunk-tokens), so the multimodal prompts prefill over
    several steps, their placeholders cut between them; greedy tokens must not change."""

    async def together() -> list[list[int]]:
        async with client_channel(vllm_epd_stack.address) as channel:
            calls = [generate(channel, request(MIXES[name]), timeout_s=120) for name in [*MIXES, *MIXES]]
            return [result.token_ids for result in await asyncio.gather(*calls)]

    assert run(together) == [expected[name] for name in [*MIXES, *MIXES]]
    _wait_empty(vllm_epd_stack)


@pytest.mark.parametrize("mix", ["image", "audio"])
def test_a_seeded_prompt_prefilled_in_chunks_samples_reproducibly(
    vllm_epd_stack: Stack, expected: dict[str, list[int]], mix: str
) -> None:
    """The stack's step budget is below every multimodal prompt, so vLLM prefills this one in chunks
    and drops a token per chunk: on a CPU worker, vLLM's rewind of a seeded request's generator
    killed the engine (libs/backends/vllm/seeded_sampling.py). The same seed draws the same tokens."""
    address = vllm_epd_stack.address
    first, again, other = (sampled_tokens(address, MIXES[mix], seed) for seed in (7, 7, 8))
    assert first == again
    assert other != first and first != expected[mix]  # sampled, not greedy
    _wait_empty(vllm_epd_stack)


def test_a_conversations_next_turn_reuses_its_tenants_prefix_image_included(vllm_epd_stack: Stack) -> None:
    """Items are named by their content within the tenant (contract 1.8's cache_salt), so the next
    turn of a conversation keeping its image hits vLLM's prefix cache past the image, another
    tenant's identical turn hits nothing of it, two turns in flight together naming the same item
    both complete, and every answer equals a prefill from nothing."""
    address = vllm_epd_stack.address
    (first,) = run_requests(address, [turn("tenant-a", None)])
    follow_up = turn("tenant-a", first.text)
    encoded = encoder_leases(vllm_epd_stack)
    again, together = run_requests(address, [follow_up, follow_up])
    assert encoder_leases(vllm_epd_stack) == encoded, "a next turn was encoded though vLLM held its image"
    (stranger,) = run_requests(address, [turn("tenant-b", first.text)])
    assert encoder_leases(vllm_epd_stack) == encoded + 1, "another tenant's turn was not encoded"
    image_end = first.prompt_tokens // 2  # the image and most of the first question lie before it
    assert again.cached_prompt_tokens > image_end and together.cached_prompt_tokens > image_end
    assert stranger.cached_prompt_tokens == 0
    assert again.token_ids == together.token_ids == stranger.token_ids
    _wait_empty(vllm_epd_stack)


def test_a_held_item_vllm_does_not_hold_is_refused_unscheduled(vllm_epd_stack: Stack) -> None:
    """An item sent as held (contract 1.9) that vLLM's prefix cache does not cover: the EC connector
    keeps the request off the model (no zeros computed or cached) and it fails FAILED_PRECONDITION
    with reason EMBEDDING_NEEDED, naming the item; the engine goes on serving."""
    layout = layout_pb2.ItemLayout(
        modality=media_pb2.MODALITY_IMAGE,
        mm_hash="ab" * 32,
        placeholder_token_count=4,
        image=layout_pb2.ImageLayout(grid_t=1, grid_h=4, grid_w=4),
    )
    held = _pd_request(layout_pb2.EncodedMedia(layout=layout, prefix_held=True))
    held.cache_salt = f"tenant-{time.monotonic_ns()}"
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        run(_prefill_decode, vllm_epd_stack.processes["pd"].address, held)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert reason_of(refused.value) == Reason.EMBEDDING_NEEDED
    assert "items[0] was sent as held" in (refused.value.details() or "")
    _wait_empty(vllm_epd_stack)
    (answer,) = run_requests(vllm_epd_stack.address, [turn("tenant-a", None)])
    assert answer.token_ids


def test_service_info_advertises_the_engine(vllm_epd_stack: Stack) -> None:
    async def info() -> service_info_pb2.ServiceInfo:
        async with open_channel(vllm_epd_stack.processes["pd"].address) as channel:
            reply = await service_info_pb2_grpc.ServiceInfoServiceStub(channel).GetServiceInfo(
                service_info_pb2.GetServiceInfoRequest(), timeout=10
            )
            return reply.info

    got = run(info)
    assert "engine.vllm" in got.capabilities
    widths = {spec.modality: (spec.width, spec.dtype) for spec in got.embedding_specs}
    assert widths[media_pb2.MODALITY_IMAGE] == (64, tensor_pb2.D_TYPE_FLOAT32)
    assert set(widths) == {media_pb2.MODALITY_IMAGE, media_pb2.MODALITY_VIDEO, media_pb2.MODALITY_AUDIO}


def test_bad_input_is_refused_before_it_reaches_vllm(vllm_epd_stack: Stack) -> None:
    pd = vllm_epd_stack.processes["pd"].address
    encoder = vllm_epd_stack.processes["encoder-0"].address
    code, details = _pd_status(pd, _pd_request(None, text="look: <|IMAGE|>"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "placeholder" in details
    encoded = run(encode_image, encoder, synthetic.png_bytes(56, 56, seed=7))
    wrong = layout_pb2.EncodedMedia()
    wrong.CopyFrom(encoded)
    wrong.embeddings.tensors[0].spec.shape[1] = 32  # not the model's width
    code, details = _pd_status(pd, _pd_request(wrong))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "embeddings" in details
    grid = layout_pb2.EncodedMedia()
    grid.CopyFrom(encoded)
    grid.layout.image.grid_w += 2  # the grid no longer fits placeholder_token_count
    code, _ = _pd_status(pd, _pd_request(grid))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    # The engine never saw them: the real item still works, and releases its lease by reading it.
    code, _ = _pd_status(pd, _pd_request(encoded))
    assert code == grpc.StatusCode.OK
    _wait_empty(vllm_epd_stack)


def test_missing_embedding_fails_the_request_and_the_engine_lives(
    vllm_epd_stack: Stack, expected: dict[str, list[int]]
) -> None:
    pd = vllm_epd_stack.processes["pd"].address
    encoder = vllm_epd_stack.processes["encoder-0"].address
    encoded = run(encode_image, encoder, synthetic.png_bytes(84, 56, seed=8))

    # The encoder frees (and poisons) the slot: PD's READ must fail, with the reason the router
    # re-encodes for.
    assert run(release, encoder, [encoded.embeddings.lease_id]) == 1
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        run(_prefill_decode, pd, _pd_request(encoded))
    code, details = caught.value.code(), caught.value.details() or ""
    assert code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DATA_LOSS, grpc.StatusCode.UNAVAILABLE), (code, details)
    assert reason_of(caught.value) == Reason.EMBEDDING_GONE and encoded.embeddings.lease_id in details
    assert run(health, pd) == health_pb2.HealthCheckResponse.SERVING
    assert call(vllm_epd_stack.address, request(MIXES["image"])).token_ids == expected["image"]
    _wait_empty(vllm_epd_stack)


def test_cancel_mid_stream_frees_the_sequence_and_the_leases(vllm_epd_stack: Stack) -> None:
    # Up to the model's length: the stream is still running when the test cancels it, on any host.
    assert run(cancel_after_chunks, vllm_epd_stack.address, request(MIXES["image"], max_tokens=LONG), 2) == 2
    _wait_empty(vllm_epd_stack)


def test_a_slow_embedding_read_holds_its_request_only(vllm_epd_stack: Stack, expected: dict[str, list[int]]) -> None:
    """The embeddings are read before vLLM sees the request: while one read waits on an encoder that
    does not answer (SIGSTOPped; over TCP a READ needs the peer's progress), a text request sent
    after it is served whole; a request whose read outlives its deadline fails DEADLINE_EXCEEDED;
    the slow one, once its encoder answers, gives the tokens of the same image read at once.

    Driven by events only: the text request starts once the slow read is in flight and must end
    while it still is, however fast or slow the host (no stream "long enough" to outlast a wait)."""
    pd = vllm_epd_stack.processes["pd"].address
    encoder = vllm_epd_stack.processes["encoder-0"]
    image = synthetic.png_bytes(84, 56, seed=9)
    # Read at once first: PD has met this encoder (first contact) before it stops answering.
    at_once = run(_prefill_decode, pd, _pd_request(run(encode_image, encoder.address, image)))
    slow_item, late_item = run(encode_image, encoder.address, image), run(encode_image, encoder.address, image)

    async def reads_in_flight(count: int) -> None:
        while (await stats(pd)).pool.slots_in_use < count:  # PD's pool: the READs' slots
            await asyncio.sleep(0.01)

    async def scenario() -> tuple[list[int], list[int], grpc.StatusCode]:
        async with open_channel(pd) as channel:
            stub = prefill_decode_pb2_grpc.PrefillDecodeServiceStub(channel)
            with frozen([psutil.Process(encoder.pid)], encoder.name) as thaw:
                slow = TokenStream(stub.PrefillDecode(_pd_request(slow_item), timeout=300))
                slow_task = asyncio.create_task(slow.run())
                await until_in_flight(pd, 1)  # admitted,
                await asyncio.wait_for(reads_in_flight(1), 120)  # and reading (its slot taken)
                # vLLM serves another request from start to end meanwhile.
                text = await asyncio.wait_for(_prefill_decode(pd, _pd_request(None, "Tell a story.", 24)), 120)
                assert not slow_task.done(), "the slow request ended while its encoder was stopped"
                with pytest.raises(grpc.aio.AioRpcError) as late:  # its deadline ends its read
                    await TokenStream(stub.PrefillDecode(_pd_request(late_item), timeout=2)).run()
                assert not slow_task.done() and not slow.tokens
                thaw()
            return await asyncio.wait_for(slow_task, 120), text, late.value.code()

    tokens, text, late_code = run(scenario)
    assert len(text) == 24
    assert late_code == grpc.StatusCode.DEADLINE_EXCEEDED
    # Given back as the router would; or already acked: its READ, posted before the deadline, landed
    # once the encoder answered again. Either way no lease is left (_wait_empty).
    assert run(release, encoder.address, [late_item.embeddings.lease_id]) in (0, 1)
    assert tokens == at_once and len(tokens) == 4
    assert call(vllm_epd_stack.address, request(MIXES["image"])).token_ids == expected["image"]
    _wait_empty(vllm_epd_stack)


def test_killed_engine_fails_requests_unavailable_then_restarts(
    vllm_epd_stack: Stack, expected: dict[str, list[int]]
) -> None:
    pd = vllm_epd_stack.processes["pd"]
    children = psutil.Process(pd.pid).children(recursive=True)
    cores = [p for p in children if "EngineCore" in p.name() + " ".join(p.cmdline())]
    assert cores, "no EngineCore process under the PD service"
    for core in cores:
        core.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 30
    statuses: set[grpc.StatusCode] = set()
    while time.monotonic() < deadline and grpc.StatusCode.UNAVAILABLE not in statuses:
        statuses.add(_pd_status(pd.address, _pd_request(None))[0])
    assert grpc.StatusCode.UNAVAILABLE in statuses
    deadline = time.monotonic() + 60  # the supervisor polls the engine twice a second (bounded generously)
    while run(health, pd.address) != health_pb2.HealthCheckResponse.NOT_SERVING:
        assert time.monotonic() < deadline, "health stayed SERVING with a dead engine"
        time.sleep(0.1)
    deadline = time.monotonic() + 300
    while run(health, pd.address) != health_pb2.HealthCheckResponse.SERVING:
        assert time.monotonic() < deadline, "the engine did not come back"
        time.sleep(1.0)
    assert pd.alive()
    assert call(vllm_epd_stack.address, request(MIXES["audio"])).token_ids == expected["audio"]
    _wait_empty(vllm_epd_stack)


DRAINED = ["image", "audio", "text"]  # streaming through the router at the PD's signal
DRAINED_TOKENS = 64  # each stream's tokens, compared with its undisturbed run's


async def _pd_drains(stack: Stack) -> tuple[int, list[str], list[list[int]]]:
    pd = stack.processes["pd"]
    async with open_channel(stack.address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        reqs = [request(MIXES[n], max_tokens=DRAINED_TOKENS) for n in DRAINED]
        # The PD's engine is stopped while the streams arrive: the PD admits them, and none can
        # advance until the test thaws it, after the signal and the probes, on a fast host as on a
        # slow one. They then stream during the drain, to their last token.
        with frozen_engine(pd) as thaw:
            streams = [TokenStream(stub.Generate(req, timeout=600)) for req in reqs]
            done = [asyncio.ensure_future(s.run()) for s in streams]
            await until_in_flight(pd.address, len(reqs))
            assert pd.process is not None
            pd.process.send_signal(signal.SIGTERM)
            at_signal = (await stats(pd.address)).requests_in_flight
            await until_draining(pd.address)
            probes = await probe_until_refused(lambda: _prefill_decode(pd.address, _pd_request(None, max_tokens=1)))
            thaw()
            return at_signal, probes, list(await asyncio.gather(*done))


@pytest.fixture(scope="module")
def door_url(vllm_epd_stack: Stack, omni_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The OpenAI door in front of the vLLM stack's router."""
    with running_door(vllm_epd_stack.address, omni_tiny, tmp_path_factory.mktemp("vllm-door")) as address:
        yield f"http://{address}/v1"


@pytest.mark.parametrize("mix", ["image", "audio", "two_images"])
def test_the_openai_door_answers_what_generate_answers(vllm_epd_stack: Stack, door_url: str, mix: str) -> None:
    """Through the door, vLLM's answer is the gRPC path's, whole and streamed (the openai client)."""
    import openai

    client = openai.OpenAI(base_url=door_url, api_key="unused", max_retries=0, timeout=120)
    messages: Any = openai_messages(request(MIXES[mix], max_tokens=8))
    whole = client.chat.completions.create(model=omni_tiny_name(), temperature=0, max_tokens=8, messages=messages)
    chunks = client.chat.completions.create(
        model=omni_tiny_name(),
        temperature=0,
        max_tokens=8,
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
    )
    streamed = [c for c in chunks]
    expected = call(vllm_epd_stack.address, request(MIXES[mix], max_tokens=8)).text
    assert whole.choices[0].message.content == expected
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected
    assert streamed[-1].usage is not None and whole.usage is not None
    assert streamed[-1].usage.completion_tokens == whole.usage.completion_tokens
    _wait_empty(vllm_epd_stack)


def test_a_client_leaving_the_door_mid_stream_frees_vllm(vllm_epd_stack: Stack, door_url: str) -> None:
    _, headers = traceparent()
    disconnect_mid_stream(door_url, omni_tiny_name(), openai_messages(request(MIXES["image"])), headers)
    _wait_empty(vllm_epd_stack)


def omni_tiny_name() -> str:
    return "qwen2_5_omni-tiny"


def test_sigterm_drains_streams_in_flight_then_exits(vllm_epd_stack: Stack) -> None:
    undisturbed = [
        call(vllm_epd_stack.address, request(MIXES[n], max_tokens=DRAINED_TOKENS), timeout_s=600).token_ids
        for n in DRAINED
    ]
    _wait_empty(vllm_epd_stack)
    at_signal, probes, finished = asyncio.run(_pd_drains(vllm_epd_stack))
    assert at_signal == len(DRAINED)  # in flight at the signal (held by the stopped engine)
    assert finished == undisturbed  # every token
    *before, refused = probes
    assert set(before) <= {"OK"} and refused.startswith("UNAVAILABLE: ") and "draining" in refused, probes
    pd = vllm_epd_stack.processes["pd"]
    assert pd.process is not None and pd.process.wait(120) == 0, pd.log_tail()
    for name, process in vllm_epd_stack.processes.items():  # every embedding the PD read was acked
        if name.startswith("encoder"):
            pool = run(stats, process.address).pool
            assert pool.slots_in_use == pool.active_leases == 0, name
