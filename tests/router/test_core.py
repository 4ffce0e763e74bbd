"""Router core without sockets: job splitting, metadata-only prefill requests, encoder choice,
retries, and lease release on every failure path (cache-aware routing: test_cache_routing.py).
StageStubs are test doubles with the generated stubs' call shapes; tests/services exercise the real
services."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from libs.contract.epd.v1 import (
    chat_pb2,
    encoder_pb2,
    generate_pb2,
    generation_pb2,
    layout_pb2,
    prefill_decode_pb2,
)
from libs.contract.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, Unavailable
from libs.contract.validation import RAW_PROMPT_CAPABILITY, SAMPLING_CAPABILITY
from services.router.core import Router
from services.router.encoders import EncoderPool
from services.router.failover import ANSWER_MARGIN_S
from services.router.policy import RpcFailed
from services.router.pool import MemberPool
from services.router.stages import Slots
from services.router.stubs import StageStubs
from tests.support.router_checks import PassingChecks
from tests.support.router_harness import Encoder, Harness, Leases, StreamCall, image_request, rpc_error

pytestmark = pytest.mark.unit

T = TypeVar("T")


def test_text_only_skips_encoders() -> None:
    h = Harness()
    assert asyncio.run(h.tokens(image_request(0))) == [7, 8, 9]
    assert h.log == []
    assert h.prefill.requests[0].messages[0].parts[0].text == "Describe."
    assert h.leases.released == {}


def test_media_become_encoded_references_spread_over_encoders() -> None:
    h = Harness()
    request = image_request(3)
    assert asyncio.run(h.tokens(request)) == [7, 8, 9]
    assert sorted(i for _, i in h.log) == [0, 1, 2]
    assert {a for a, _ in h.log} == {"enc0", "enc1"}  # least outstanding work spreads the jobs
    (sent,) = h.prefill.requests
    kinds = [p.WhichOneof("kind") for p in sent.messages[0].parts]
    assert kinds == ["encoded", "encoded", "encoded", "text"]  # metadata-only, order kept
    assert [p.encoded.layout.item_index for p in sent.messages[0].parts[:3]] == [0, 1, 2]
    assert not any(p.HasField("media") for p in sent.messages[0].parts)
    assert sent.sampling == request.sampling and sent.messages[0].parts[3].text == "Describe."
    assert h.decode.requests[0].kv_cache.handle.lease_id == "kv-lease-1"
    assert h.leases.released == {}  # consumers acked everything


def test_encoder_unavailable_is_retried_on_another() -> None:
    h = Harness(fail={"enc0": grpc.StatusCode.UNAVAILABLE})
    assert asyncio.run(h.tokens(image_request(2))) == [7, 8, 9]
    assert [a for a, _ in h.log].count("enc1") == 2


def test_every_encoder_down_fails_unavailable_and_releases() -> None:
    h = Harness(fail={"enc0": grpc.StatusCode.UNAVAILABLE, "enc1": grpc.StatusCode.UNAVAILABLE})
    with pytest.raises(RpcFailed) as caught:
        asyncio.run(h.tokens(image_request(1)))
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE and caught.value.stage == "encode"
    assert h.prefill.requests == []


def test_a_failing_item_is_retried_on_one_other_encoder_only() -> None:
    h = Harness(n_encoders=3, fail={f"enc{i}": grpc.StatusCode.INTERNAL for i in range(3)})
    with pytest.raises(RpcFailed) as caught:
        asyncio.run(h.tokens(image_request(1)))
    assert caught.value.code == grpc.StatusCode.INTERNAL and len(h.log) == 2  # a bad item visits two at most


def test_bad_media_is_invalid_argument_and_other_leases_are_released() -> None:
    h = Harness(n_encoders=2)  # slack 0: the two items go to the two encoders, a call each
    request = image_request(2)

    async def run() -> None:
        for encoder in h.encoders.values():
            original = encoder.Encode

            async def encode(req: encoder_pb2.EncodeRequest, timeout: float | None = None, o: Any = original) -> Any:
                if req.items[0].item_index == 1:
                    raise rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "items[0].media.data: corrupt image")
                return await o(req, timeout=timeout)

            encoder.Encode = encode  # type: ignore[method-assign]
        await h.tokens(request)

    with pytest.raises(InvalidArgument) as caught:
        asyncio.run(run())
    assert caught.value.field == "media item 1" and "corrupt image" in caught.value.problem
    ((address, index),) = h.log  # the good item's encoder: its lease given back
    assert index == 0 and h.leases.released == {address: {f"{address}/1"}}
    assert h.prefill.requests == []


def test_a_requests_items_on_one_encoder_go_in_one_call_in_request_order() -> None:
    h = Harness(n_encoders=1)
    assert asyncio.run(h.tokens(image_request(3))) == [7, 8, 9]
    (call,) = h.encoders["enc0"].requests
    assert [i.item_index for i in call.items] == [0, 1, 2]
    assert [i.media.data for i in call.items] == [p.media.data for p in image_request(3).messages[0].parts[:3]]
    (sent,) = h.prefill.requests
    placed = [p.encoded.layout.item_index for m in sent.messages for p in m.parts if p.HasField("encoded")]
    assert placed == [0, 1, 2]


def test_a_bad_item_in_a_shared_call_is_named_by_its_request_index() -> None:
    h = Harness(n_encoders=1)

    async def encode(req: encoder_pb2.EncodeRequest, timeout: float | None = None) -> Any:
        raise rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "items[2].media.data: corrupt image")

    h.encoders["enc0"].Encode = encode  # type: ignore[method-assign]
    with pytest.raises(InvalidArgument) as caught:
        asyncio.run(h.tokens(image_request(3)))
    assert caught.value.field == "media item 2" and "corrupt image" in caught.value.problem
    assert h.leases.released == {} and h.prefill.requests == []

    async def unnamed(req: encoder_pb2.EncodeRequest, timeout: float | None = None) -> Any:
        raise rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "request: too large")

    h.encoders["enc0"].Encode = unnamed  # type: ignore[method-assign]
    with pytest.raises(InvalidArgument) as caught:  # no item named: the call's items, not a guess
        asyncio.run(h.tokens(image_request(3)))
    assert caught.value.field == "media items 0, 1, 2"


def test_a_shared_call_that_fails_moves_whole_to_another_encoder() -> None:
    h = Harness(n_encoders=2)
    calls: list[tuple[str, list[int]]] = []
    for address, encoder in h.encoders.items():
        original = encoder.Encode

        async def encode(
            req: encoder_pb2.EncodeRequest, timeout: float | None = None, o: Any = original, at: str = address
        ) -> Any:
            calls.append((at, [i.item_index for i in req.items]))
            if len(calls) == 1:
                raise rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused")
            return await o(req, timeout=timeout)

        encoder.Encode = encode  # type: ignore[method-assign]
    # The same image twice: one content hash, so one placement and one call.
    assert asyncio.run(h.tokens(image_request(2, same=True))) == [7, 8, 9]
    (first, items), (second, again) = calls
    assert items == again == [0, 1] and first != second
    assert h.leases.released == {}


def test_decode_failure_releases_the_kv_lease() -> None:
    h = Harness(decode_fail_before=True)

    async def run() -> list[int]:
        out: list[int] = []
        with pytest.raises(RpcFailed) as caught:
            async for response in h.router.generate(image_request(1)):
                out.extend(response.chunk.token_ids)
        assert caught.value.code == grpc.StatusCode.UNAVAILABLE and caught.value.stage == "decode"
        return out

    assert asyncio.run(run()) == [7]  # the first token was already streamed
    assert h.leases.released == {"127.0.0.1:50061": {"kv-lease-1"}}


@pytest.mark.parametrize("code", [grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DATA_LOSS])
def test_kv_gone_before_decode_read_it_is_recomputed_once(code: grpc.StatusCode) -> None:
    # E.g. the KV lease expired while the router waited for a restarting decode.
    h = Harness(decode_fail_first=[code])
    assert asyncio.run(h.tokens(image_request(1))) == [7, 8, 9]  # the first token is not repeated
    assert len(h.log) == 2 and len(h.prefill.requests) == 2 and len(h.decode.requests) == 2
    assert [r.kv_cache.handle.lease_id for r in h.decode.requests] == ["kv-lease-1", "kv-lease-2"]
    # The lost KV's lease is released (prefill acked the embeddings it read); decode acked the new KV.
    assert h.leases.released == {"127.0.0.1:50061": {"kv-lease-1"}}


def test_kv_gone_twice_fails_with_decodes_status() -> None:
    h = Harness(decode_fail_first=[grpc.StatusCode.NOT_FOUND] * 2)

    async def run() -> list[int]:
        out: list[int] = []
        with pytest.raises(RpcFailed) as caught:
            async for response in h.router.generate(image_request(1)):
                out.extend(response.chunk.token_ids)
        assert caught.value.code == grpc.StatusCode.NOT_FOUND and "kv-lease-2 expired" in str(caught.value)
        return out

    assert asyncio.run(run()) == [7]
    assert len(h.prefill.requests) == 2  # one recompute, no more


def test_kv_recomputed_with_another_first_token_is_data_loss() -> None:
    # Unseeded sampling may pick another first token: the stream cannot be continued consistently.
    h = Harness(decode_fail_first=[grpc.StatusCode.NOT_FOUND], prefill_first_tokens=(7, 5))

    async def run() -> list[int]:
        out: list[int] = []
        with pytest.raises(RpcFailed) as caught:
            async for response in h.router.generate(image_request(1)):
                out.extend(response.chunk.token_ids)
        assert caught.value.code == grpc.StatusCode.DATA_LOSS and "first token differs" in str(caught.value)
        return out

    assert asyncio.run(run()) == [7]
    assert len(h.decode.requests) == 1  # decode never got the inconsistent KV
    assert {"kv-lease-1", "kv-lease-2"} <= set().union(*h.leases.released.values())


def test_other_decode_failures_are_not_recomputed() -> None:
    h = Harness(decode_fail_first=[grpc.StatusCode.INTERNAL])
    with pytest.raises(RpcFailed):
        asyncio.run(h.tokens(image_request(1)))
    assert len(h.prefill.requests) == 1


def test_client_cancel_releases_what_the_request_holds() -> None:
    h = Harness()

    async def run() -> None:
        stream = h.router.generate(image_request(1))
        first = await stream.__anext__()
        assert list(first.chunk.token_ids) == [7]
        await stream.aclose()  # the client went away after the first token

    asyncio.run(run())
    assert h.leases.released == {"127.0.0.1:50061": {"kv-lease-1"}}


def test_a_client_that_lags_gets_what_queued_up_as_one_message() -> None:
    """One message per token while the client keeps up; decode's tokens that arrived while it did
    not are relayed merged (their text, finish and usage with them), not one message each."""
    kept_up = Harness()

    async def one_by_one() -> list[list[int]]:
        return [list(r.chunk.token_ids) async for r in kept_up.router.generate(image_request(1))]

    assert asyncio.run(one_by_one()) == [[7], [8], [9], []]  # the last: the finish and usage

    h = Harness()

    async def lagging() -> list[generate_pb2.GenerateResponse]:
        stream = h.router.generate(image_request(1))
        got = [await anext(stream)]  # prefill's token, at once
        for _ in range(1000):  # the client reads no more until decode's stream has ended
            if h.decode.calls and h.decode.calls[0].ended:
                break
            await asyncio.sleep(0)
        return got + [r async for r in stream]

    first, rest = asyncio.run(lagging())
    assert list(first.chunk.token_ids) == [7] and list(rest.chunk.token_ids) == [8, 9]
    assert rest.chunk.finish_reason == generation_pb2.FINISH_REASON_LENGTH
    assert rest.usage.completion_tokens == 3 and h.decode.calls[0].ended and not h.decode.calls[0].cancelled


def test_without_coalescing_a_lagging_reader_gets_one_response_per_chunk() -> None:
    """`coalesce=False` (the door in the router's process relays merged itself): decode's tokens that
    queued up while the reader lagged still come one response each, none lost, in order."""
    h = Harness()

    async def lagging() -> list[list[int]]:
        stream = h.router.generate(image_request(1), coalesce=False)
        got = [list((await anext(stream)).chunk.token_ids)]
        for _ in range(100):  # no relay task reads ahead: decode waits for this reader
            await asyncio.sleep(0)
        return got + [list(r.chunk.token_ids) async for r in stream]

    assert asyncio.run(lagging()) == [[7], [8], [9], []]
    assert h.decode.calls[0].ended and not h.decode.calls[0].cancelled


def test_client_gone_mid_decode_cancels_the_decode_call() -> None:
    h = Harness()

    async def run() -> None:
        stream = h.router.generate(image_request(1))
        assert [t for t in (await stream.__anext__()).chunk.token_ids] == [7]  # prefill's
        assert [t for t in (await stream.__anext__()).chunk.token_ids] == [8]  # decode's first
        await stream.aclose()  # the client went away mid-decode

    asyncio.run(run())
    (call,) = h.decode.calls
    assert call.cancelled  # decode stops generating, instead of running on to max_tokens

    finished = Harness()
    assert asyncio.run(finished.tokens(image_request(1))) == [7, 8, 9]
    assert not finished.decode.calls[0].cancelled  # a stream read to its end is left alone


def _traced(run: Callable[[], Awaitable[T]]) -> tuple[T, Mapping[str, Any]]:
    """`run()` under a recording root span (as the Generate server span is); its attributes."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    async def under_root() -> T:
        with provider.get_tracer("test").start_as_current_span("GenerateService/Generate"):
            return await run()

    result = asyncio.run(under_root())
    (root,) = [span for span in exporter.get_finished_spans() if span.name == "GenerateService/Generate"]
    return result, dict(root.attributes or {})


def test_e_p_d_root_span_gets_the_time_to_first_token() -> None:
    h = Harness()
    tokens, root = _traced(lambda: h.tokens(image_request(1)))
    assert tokens == [7, 8, 9] and root["epd.ttft_s"] > 0


def test_e_plus_pd_layout() -> None:
    seen: list[prefill_decode_pb2.PrefillDecodeRequest] = []
    calls: list[StreamCall] = []

    class PD:
        def PrefillDecode(self, request: Any, timeout: float | None = None, **_: Any) -> StreamCall:
            seen.append(request)

            async def stream() -> AsyncIterator[Any]:
                for token in (5, 6):
                    yield prefill_decode_pb2.PrefillDecodeResponse(chunk=generation_pb2.TokenChunk(token_ids=[token]))

            calls.append(StreamCall(stream()))
            return calls[-1]

    log: list[tuple[str, int]] = []
    pd = PD()
    router = Router(
        StageStubs(
            encoder=lambda a: Encoder(a, log), lease=Leases().stub, checks=PassingChecks(), prefill_decode=lambda a: pd
        ),
        EncoderPool(["e"]),
    )

    async def run() -> list[int]:
        return [t async for r in router.generate(image_request(1)) for t in r.chunk.token_ids]

    tokens, root = _traced(run)
    assert tokens == [5, 6]
    assert root["epd.ttft_s"] > 0  # the time to first token reaches the request's root span
    assert seen[0].messages[0].parts[0].WhichOneof("kind") == "encoded"
    assert isinstance(seen[0].messages[0].parts[0].encoded, layout_pb2.EncodedMedia)
    assert not calls[0].cancelled

    async def leave_after_one() -> None:
        stream = router.generate(image_request(1))
        await stream.__anext__()
        await stream.aclose()  # the client went away mid-stream

    asyncio.run(leave_after_one())
    assert calls[1].cancelled  # PD stops generating too


def test_invalid_client_request_is_rejected_before_any_work() -> None:
    h = Harness()
    request = image_request(1)
    request.sampling.top_p = 2.0
    with pytest.raises(InvalidArgument, match=r"sampling\.top_p"):
        asyncio.run(h.tokens(request))
    assert h.log == []


def test_incompatible_encoder_is_skipped_at_first_contact() -> None:
    h = Harness()
    checked: list[tuple[str, str | None]] = []

    async def check(address: str, instance_id: str | None) -> None:
        checked.append((address, instance_id))
        if address == "enc0":
            raise FailedPrecondition("peer enc0 serves other-model; this service serves tiny")

    h.checks.on_encoder = check
    assert asyncio.run(h.tokens(image_request(2))) == [7, 8, 9]
    assert {a for a, _ in h.log} == {"enc1"}  # enc0 never computed anything
    assert ("enc0", None) in checked

    async def refuse(address: str, instance_id: str | None) -> None:
        raise FailedPrecondition(f"peer {address} is incompatible")

    h.checks.on_encoder = refuse
    with pytest.raises(FailedPrecondition, match="incompatible"):
        asyncio.run(h.tokens(image_request(1)))


def test_encoder_gone_right_after_answering_is_an_encode_failure_retried_elsewhere() -> None:
    """Its answer's handle names its incarnation; re-checking it finds the encoder unreachable (it
    was killed): the embedding went with it, so the item is encoded on another encoder."""
    h = Harness()
    gone: list[str] = []

    async def check(address: str, instance_id: str | None) -> None:
        if instance_id is not None and not gone:  # the first encoder to answer dies right after
            gone.append(address)
            raise Unavailable(f"peer {address} unreachable: UNAVAILABLE connection refused")

    h.checks.on_encoder = check
    assert asyncio.run(h.tokens(image_request(1))) == [7, 8, 9]
    (dead,) = gone
    (other,) = set(h.encoders) - {dead}
    assert h.log == [(dead, 0), (other, 0)]
    (sent,) = h.prefill.requests
    assert sent.messages[0].parts[0].encoded.embeddings.agent.producer_address == other
    assert h.leases.released == {dead: {f"{dead}/1"}}  # given up, best effort


def test_encoder_dropped_from_membership_during_its_failing_call_is_retried_on_one_left() -> None:
    """An encoder exited (drained) while still listed: a request's call to it fails "connection
    refused" just as membership drops it, leaving one member. The one left, untried, takes the item
    (a retry bounded by the pool's size *now* would give up: seen once in CI)."""
    h = Harness()
    gone: list[str] = []
    for address, encoder in h.encoders.items():

        async def leaving(
            request: Any, timeout: float | None = None, address: str = address, real: Any = encoder.Encode
        ) -> Any:
            if not gone:  # the first encoder called has exited and leaves the members meanwhile
                gone.append(address)
                h.pool.update([a for a in h.encoders if a != address])
                raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"failed to connect to {address}: Connection refused")
            return await real(request, timeout)

        encoder.Encode = leaving  # type: ignore[method-assign]
    assert asyncio.run(h.tokens(image_request(1))) == [7, 8, 9]
    (dead,) = gone
    (other,) = set(h.encoders) - {dead}
    assert h.log == [(other, 0)] and h.pool.size == 1


# How a stage going away for a restart answers: its admission refuses while it drains, then grpc
# core cancels the calls still queued when the server stops (libs/rpc/retry.py).
GOING_AWAY = {
    "draining": (grpc.StatusCode.UNAVAILABLE, "stage is draining for shutdown; retry elsewhere or later"),
    "stopped": (grpc.StatusCode.CANCELLED, "CANCELLED"),
}


@pytest.mark.parametrize("how", sorted(GOING_AWAY))
def test_singleton_stage_going_away_for_a_restart_is_waited_out(how: str) -> None:
    code, details = GOING_AWAY[how]
    h = Harness()
    calls = {"prefill": 0, "decode": 0}
    prefill, decode = h.prefill.Prefill, h.decode.Decode

    async def refusing_prefill(request: Any, timeout: float | None = None, **kw: Any) -> Any:
        calls["prefill"] += 1
        if calls["prefill"] <= 2:
            raise rpc_error(code, details)
        return await prefill(request, timeout=timeout)

    def refusing_decode(request: Any, timeout: float | None = None, **kw: Any) -> StreamCall:
        calls["decode"] += 1
        if calls["decode"] <= 2:

            async def refuse() -> AsyncIterator[Any]:
                raise rpc_error(code, details)
                yield  # pragma: no cover

            return StreamCall(refuse())
        return decode(request, timeout=timeout)

    h.prefill.Prefill = refusing_prefill  # type: ignore[method-assign]
    h.decode.Decode = refusing_decode  # type: ignore[method-assign]
    assert asyncio.run(h.tokens(image_request(1))) == [7, 8, 9]
    assert calls == {"prefill": 3, "decode": 3}
    assert len(h.log) == 1  # waited out, not re-encoded
    assert h.leases.released == {}  # nothing was abandoned on the way


@pytest.mark.parametrize("how", sorted(GOING_AWAY))
def test_every_encoder_going_away_is_waited_out(how: str) -> None:
    code, details = GOING_AWAY[how]
    h = Harness()
    refusals: list[str] = []
    for encoder in h.encoders.values():
        original = encoder.Encode

        async def encode(req: Any, timeout: float | None = None, _o: Any = original, _a: str = encoder.address) -> Any:
            if len(refusals) < 4:  # both encoders, twice each
                refusals.append(_a)
                raise rpc_error(code, details)
            return await _o(req, timeout=timeout)

        encoder.Encode = encode  # type: ignore[method-assign]
    assert asyncio.run(h.tokens(image_request(1))) == [7, 8, 9]
    assert sorted(refusals) == ["enc0", "enc0", "enc1", "enc1"]
    assert len(h.log) == 1


def test_a_stage_that_keeps_refusing_fails_at_the_deadline() -> None:
    h = Harness()

    async def refusing_prefill(request: Any, timeout: float | None = None, **kw: Any) -> Any:
        raise rpc_error(grpc.StatusCode.CANCELLED, "CANCELLED")

    h.prefill.Prefill = refusing_prefill  # type: ignore[method-assign]

    async def run() -> None:
        async for _ in h.router.generate(image_request(1), deadline=time.monotonic() + 1.5):
            pass

    with pytest.raises(RpcFailed) as failed:
        asyncio.run(run())
    assert failed.value.code == grpc.StatusCode.CANCELLED and failed.value.stage == "prefill"
    assert sum(len(ids) for ids in h.leases.released.values()) == 1  # the embedding's lease, released


def test_other_unavailable_from_prefill_is_not_retried_as_a_drain() -> None:
    h = Harness(prefill_fail_first=grpc.StatusCode.UNAVAILABLE)  # an encoder gone: re-encode instead
    assert asyncio.run(h.tokens(image_request(1))) == [7, 8, 9]
    assert len(h.log) == 2 and len(h.prefill.requests) == 2


def test_priority_is_forwarded_only_to_peers_that_honor_it() -> None:
    h = Harness()
    h.stages.prefill, h.stages.decode = MemberPool(["p:1"]), MemberPool(["d:1"])
    honoring = {"enc1", "p:1"}  # enc0 and decode speak contract 1.0: no "admission.priority"
    h.checks.honoring = lambda address, capability: address in honoring
    seen: list[tuple[str, int]] = []
    for encoder in h.encoders.values():
        original = encoder.Encode

        async def encode(req: Any, timeout: float | None = None, _o: Any = original, _a: str = encoder.address) -> Any:
            seen.append((_a, req.priority))
            return await _o(req, timeout=timeout)

        encoder.Encode = encode  # type: ignore[method-assign]
    request = image_request(2)
    request.priority = 7
    assert asyncio.run(h.tokens(request)) == [7, 8, 9]
    assert sorted(seen) == [("enc0", 0), ("enc1", 7)]
    assert h.prefill.requests[0].priority == 7
    assert h.decode.requests[0].priority == 0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 0.5),
        ("frequency_penalty", -0.5),
        ("repetition_penalty", 1.0),  # set, even to its default: an old peer would not know it
        ("min_tokens", 2),
        ("ignore_eos", True),
        ("logprobs", 0),
    ],
)
def test_a_contract_1_6_sampling_field_is_refused_for_a_stage_speaking_an_older_minor(field: str, value: Any) -> None:
    h = Harness()
    h.stages.prefill, h.stages.decode = MemberPool(["p:1"]), MemberPool(["d:1"])
    advertising = {"p:1"}  # decode speaks contract 1.5: no "sampling.openai"
    h.checks.honoring = lambda address, capability: capability == SAMPLING_CAPABILITY and address in advertising
    request = image_request(1)
    setattr(request.sampling, field, value)
    with pytest.raises(InvalidArgument) as caught:
        asyncio.run(h.tokens(request))
    assert caught.value.field == f"sampling.{field}"
    assert "decode service at d:1 does not advertise sampling.openai" in caught.value.problem
    assert not h.decode.requests  # never sent where it would be dropped
    advertising.add("d:1")
    assert asyncio.run(h.tokens(request)) == [7, 8, 9]  # once decode speaks 1.6 it goes through
    advertising.discard("p:1")
    with pytest.raises(InvalidArgument, match="prefill service at p:1 does not advertise"):
        asyncio.run(h.tokens(request))
    # A request without 1.6 fields still goes to the older stage.
    assert asyncio.run(h.tokens(image_request(1))) == [7, 8, 9]


def test_a_raw_prompt_goes_only_to_a_prefill_advertising_prompt_raw() -> None:
    h = Harness()
    h.stages.prefill, h.stages.decode = MemberPool(["p:1"]), MemberPool(["d:1"])
    advertising: set[str] = set()
    h.checks.honoring = lambda address, capability: capability == RAW_PROMPT_CAPABILITY and address in advertising
    request = generate_pb2.GenerateRequest(
        request_id="raw",
        messages=[chat_pb2.ChatMessage(role=chat_pb2.CHAT_ROLE_RAW, parts=[chat_pb2.ContentPart(text="Once upon")])],
    )
    with pytest.raises(InvalidArgument) as caught:
        asyncio.run(h.tokens(request))
    assert caught.value.field == "messages[0].role"
    assert "prefill service at p:1 does not advertise prompt.raw" in caught.value.problem
    assert not h.prefill.requests
    advertising.add("p:1")
    assert asyncio.run(h.tokens(request)) == [7, 8, 9]
    assert h.prefill.requests[-1].messages[0].role == chat_pb2.CHAT_ROLE_RAW  # passed on as it is


def test_jobs_beyond_an_encoders_in_flight_bound_wait_in_the_router() -> None:
    """More calls than the bound: the encoder never has more than `encode_in_flight` calls; the
    rest wait in the router (not refused) and go out as calls end."""
    h = Harness(n_encoders=1, encode_in_flight=2)
    encoder = h.encoders["enc0"]
    original = encoder.Encode
    gate = asyncio.Event()
    in_flight, most = 0, 0

    async def encode(req: encoder_pb2.EncodeRequest, timeout: float | None = None) -> Any:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        try:
            await gate.wait()
            return await original(req, timeout=timeout)
        finally:
            in_flight -= 1

    encoder.Encode = encode  # type: ignore[method-assign]

    async def run() -> list[list[int]]:
        task = asyncio.gather(*(h.tokens(image_request(1)) for _ in range(5)))  # a call each
        for _ in range(1000):  # bounded: the five jobs reach the encoder or its bound
            if in_flight == 2:
                break
            await asyncio.sleep(0)
        for _ in range(50):  # the other three had every chance to get through: they must not
            await asyncio.sleep(0)
        assert (in_flight, len(h.log)) == (2, 0)
        gate.set()
        return await task

    assert asyncio.run(run()) == [[7, 8, 9]] * 5
    assert most == 2 and len(h.log) == 5
    assert h.leases.released == {}


def test_a_job_waiting_for_an_encoder_slot_past_its_deadline_fails_and_the_slot_survives() -> None:
    from libs.contract.errors import DeadlineExceeded
    from services.router.failover import ANSWER_MARGIN_S
    from tests.support.router_harness import rpc_error as error

    h = Harness(n_encoders=1, encode_in_flight=1)
    encoder = h.encoders["enc0"]
    original = encoder.Encode
    gate = asyncio.Event()

    async def encode(req: encoder_pb2.EncodeRequest, timeout: float | None = None) -> Any:
        try:
            await asyncio.wait_for(gate.wait(), timeout)
        except TimeoutError:
            raise error(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline") from None
        return await original(req, timeout=timeout)

    encoder.Encode = encode  # type: ignore[method-assign]

    async def run() -> list[int]:
        deadline = time.monotonic() + ANSWER_MARGIN_S + 0.2  # the second item waits for the slot past it
        with pytest.raises((DeadlineExceeded, RpcFailed)):
            async for _ in h.router.generate(image_request(2), deadline):
                pass
        gate.set()
        return await h.tokens(image_request(1))  # the one slot is free again: not lost to the timeout

    assert asyncio.run(run()) == [7, 8, 9]


@pytest.mark.parametrize("bound", ["set", "advertised"])
def test_decode_slots_hold_prefills_until_a_decode_ends(bound: str) -> None:
    """A request whose decode would queue waits before its prefill (its time to first token), and
    starts once a decode ends: with `decode_in_flight` set, or as the decode advertises it (1.7)."""
    h = Harness(decode_in_flight=1) if bound == "set" else Harness()
    h.checks.running = lambda address: 1
    slots = h.router._clients._decode_slots
    assert slots is not None

    async def run() -> tuple[list[int], list[int], int]:
        h.decode.gate = asyncio.Event()
        async with asyncio.timeout(30):
            first = asyncio.create_task(h.tokens(image_request(1)))
            while not h.decode.requests:  # the first request decodes, held at the gate
                await asyncio.sleep(0)
            second = asyncio.create_task(h.tokens(image_request(1)))
            while not slots.waiting:  # the second waits for the slot
                await asyncio.sleep(0)
            prefills_while_held = len(h.prefill.requests)
            h.decode.gate.set()
            return await first, await second, prefills_while_held

    first, second, prefills_while_held = asyncio.run(run())
    assert first == second == [7, 8, 9]
    assert prefills_while_held == 1
    assert len(h.prefill.requests) == 2 and slots.waiting == 0


def test_a_one_token_request_takes_no_decode_slot() -> None:
    """max_tokens 1: prefill's token is the whole answer, so it never waits for decode's slots (a
    decode held full, or a prefill stuck with the slots, does not hold it back)."""
    h = Harness(decode_in_flight=1)
    slots = h.router._clients._decode_slots
    assert slots is not None

    async def run() -> list[int]:
        h.decode.gate = asyncio.Event()
        async with asyncio.timeout(30):
            held = asyncio.create_task(h.tokens(image_request(1)))
            while not h.decode.requests:  # the only slot, held in decode
                await asyncio.sleep(0)
            one = image_request(1)
            one.sampling.max_tokens = 1
            tokens = await h.tokens(one)
            assert slots.waiting == 0
            h.decode.gate.set()
            await held
            return tokens

    assert asyncio.run(run()) == [7]


def test_advertised_decode_slots_are_the_members_sum() -> None:
    """By default the bound is what the decode members advertise, summed; a member not contacted yet
    counts as the largest advertised, and one that advertises nothing (a peer before 1.7) or a pool
    nobody contacted yet lifts it; `decode_in_flight` > 0 is per member, whatever they advertise."""
    h = Harness()
    decode = h.stages.decode
    assert decode is not None
    decode.update(["d1", "d2", "d3"])
    advertised: dict[str, int] = {}
    h.checks.running = advertised.get
    capacity = h.router._clients._decode_capacity
    assert capacity() >= 1 << 30  # no member contacted yet
    advertised.update(d1=8, d2=4)
    assert capacity() == 8 + 4 + 8
    advertised["d3"] = 0
    assert capacity() >= 1 << 30
    assert Harness(decode_in_flight=2).router._clients._decode_capacity() == 2
    assert Harness(decode_in_flight=0).router._clients._decode_slots is None


def test_decode_slots_keep_order_honour_deadlines_and_pass_on_a_cancelled_wait() -> None:
    async def run() -> None:
        capacity = 1
        slots = Slots(lambda: capacity, "a decode slot")
        order: list[str] = []

        async def hold(name: str, release: asyncio.Event, deadline: float | None = None) -> None:
            async with slots.held("router.decode_queue", deadline):
                order.append(name)
                await release.wait()

        releases = {n: asyncio.Event() for n in "abcd"}
        a = asyncio.create_task(hold("a", releases["a"]))
        b = asyncio.create_task(hold("b", releases["b"]))
        c = asyncio.create_task(hold("c", releases["c"]))
        while slots.waiting < 2:
            await asyncio.sleep(0)
        b.cancel()  # a wait given up: its turn passes on
        with pytest.raises(DeadlineExceeded, match="a decode slot"):
            await hold("d", releases["d"], deadline=time.monotonic() + ANSWER_MARGIN_S + 0.2)  # held throughout
        releases["a"].set()
        releases["c"].set()
        await asyncio.gather(a, c)
        assert b.cancelled() and order == ["a", "c"]
        capacity = 2  # read at each acquire (a decode pool that grew)
        both = [asyncio.create_task(hold(n, releases[n])) for n in "bd"]
        while len(order) < 4:
            await asyncio.sleep(0)
        releases["b"].set()
        releases["d"].set()
        await asyncio.gather(*both)

    asyncio.run(run())
