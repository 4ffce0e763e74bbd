"""Prefill, decode and PD pools in the router core, without sockets: the picker (least outstanding,
round robin on ties, draining and departed members), the KV handoff to any decode, retries on
another member before the first token, per-member checks, and leases released at the producer
that holds them. tests/services/test_pools.py runs the real services."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from libs.contract.epd.v1 import chat_pb2, decode_pb2, generate_pb2, generation_pb2, prefill_decode_pb2, prefill_pb2
from libs.contract.errors import FailedPrecondition, Unavailable
from libs.rpc.retry import DRAINING
from services.router.affinity import conversation_key
from services.router.core import Router
from services.router.encoders import EncoderPool
from services.router.pool import MemberPool
from services.router.stubs import Stages, StageStubs
from tests.support import samples
from tests.support.router_checks import PassingChecks
from tests.support.router_harness import Encoder, Leases, StreamCall, image_request, rpc_error

pytestmark = pytest.mark.unit


def test_least_outstanding_with_round_robin_on_ties() -> None:
    pool = MemberPool(["a", "b", "c"], stage="prefill")
    assert [pool.pick() for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]
    pool.begin("a")
    pool.begin("b")
    assert [pool.pick() for _ in range(2)] == ["c", "c"]  # the only idle one, while the others are busy
    pool.begin("c")
    pool.begin("c")
    assert pool.pick() in {"a", "b"}
    assert pool.pick(exclude={"a", "b"}) == "c"
    with pytest.raises(Unavailable, match="no prefill left to try"):
        pool.pick(exclude={"a", "b", "c"})


def test_members_change_draining_is_avoided_and_departed_are_never_picked() -> None:
    pool = MemberPool([], stage="decode", dynamic=True)
    with pytest.raises(Unavailable, match="no decode"):
        pool.pick()
    pool.update(["a", "b"])
    pool.draining("a")
    assert {pool.pick() for _ in range(4)} == {"b"}
    assert pool.pick(exclude={"b"}) == "a"  # the only one left: still tried
    pool.begin("b")
    assert pool.update(["a"]) == []  # b leaves with a call in flight: its channel stays
    assert {pool.pick() for _ in range(3)} == {"a"}  # (draining, but the only member)
    pool.end("b")
    assert pool.update(["a", "c"]) == ["b"]
    assert pool.pick() == "c"  # the new member at once
    assert pool.untried({"a"}) and not pool.untried({"a", "c"})
    with pytest.raises(ValueError, match="at least one decode address"):
        MemberPool([], stage="decode")


class Prefill:
    """One prefill member: its KV handles name it as their producer."""

    def __init__(self, address: str, refuse: grpc.StatusCode | None = None, details: str = DRAINING) -> None:
        self.address, self.refuse, self.details = address, refuse, details
        self.requests: list[prefill_pb2.PrefillRequest] = []

    async def Prefill(self, request: prefill_pb2.PrefillRequest, timeout: float | None = None, **kw: Any) -> Any:
        self.requests.append(request)
        if self.refuse is not None:
            raise rpc_error(self.refuse, self.details)
        await asyncio.sleep(0.02)
        kv = samples.kv_cache(tokens=10)
        kv.handle.agent.producer_address = self.address
        kv.handle.lease_id = f"{self.address}/kv{len(self.requests)}"
        return prefill_pb2.PrefillResponse(
            first_chunk=generation_pb2.TokenChunk(token_ids=[7]),
            kv_cache=kv,
            decode_state=prefill_pb2.DecodeState(next_input_token_id=7, generated_tokens=1, prompt_tokens=10),
        )


class Decode:
    def __init__(self, address: str, refuse: grpc.StatusCode | None = None) -> None:
        self.address, self.refuse = address, refuse
        self.requests: list[decode_pb2.DecodeRequest] = []

    def Decode(self, request: decode_pb2.DecodeRequest, timeout: float | None = None, **kw: Any) -> StreamCall:
        self.requests.append(request)

        async def stream() -> AsyncIterator[Any]:
            if self.refuse is not None:
                raise rpc_error(self.refuse, DRAINING)
            await asyncio.sleep(0.02)
            for token in (8, 9):
                yield decode_pb2.DecodeResponse(chunk=generation_pb2.TokenChunk(token_ids=[token]))

        return StreamCall(stream())


class Pools:
    def __init__(self, prefills: list[Prefill], decodes: list[Decode]) -> None:
        self.prefills = {p.address: p for p in prefills}
        self.decodes = {d.address: d for d in decodes}
        self.log: list[tuple[str, int]] = []
        self.leases = Leases()
        self.checked: list[tuple[str, ...]] = []
        self.checks = PassingChecks()
        self.stubs = StageStubs(
            encoder=lambda a: Encoder(a, self.log),
            lease=self.leases.stub,
            checks=self.checks,
            prefill=self.prefills.__getitem__,
            decode=self.decodes.__getitem__,
        )
        self.stages = Stages(MemberPool(list(self.prefills), stage="prefill"), MemberPool(list(self.decodes)))
        self.router = Router(self.stubs, EncoderPool(["enc0"]), stages=self.stages)

    async def tokens(self, images: int = 1) -> list[int]:
        return [t async for r in self.router.generate(image_request(images)) for t in r.chunk.token_ids]

    def run(self, requests: int) -> list[list[int]]:
        async def go() -> list[list[int]]:
            return list(await asyncio.gather(*(self.tokens() for _ in range(requests))))

        return asyncio.run(go())


def test_concurrent_requests_spread_over_both_pools_and_the_kv_goes_to_any_decode() -> None:
    pools = Pools([Prefill("p0:1"), Prefill("p1:1")], [Decode("d0:1"), Decode("d1:1")])
    assert pools.run(8) == [[7, 8, 9]] * 8
    # Concurrent arrivals alternate (least outstanding, round robin on ties); timing may skew it a little.
    assert all(len(p.requests) >= 3 for p in pools.prefills.values())
    assert all(len(d.requests) >= 3 for d in pools.decodes.values())
    assert sum(len(d.requests) for d in pools.decodes.values()) == 8
    producers = Counter(r.kv_cache.handle.agent.producer_address for d in pools.decodes.values() for r in d.requests)
    assert producers == {a: len(p.requests) for a, p in pools.prefills.items()}  # handles name their producer
    assert pools.leases.released == {}  # every consumer acked: nothing to release
    assert all(n == 0 for n in pools.stages.prefill.outstanding.values())  # type: ignore[union-attr]


def test_a_draining_prefill_is_retried_elsewhere_and_then_avoided() -> None:
    pools = Pools([Prefill("p0:1", refuse=grpc.StatusCode.UNAVAILABLE), Prefill("p1:1")], [Decode("d0:1")])
    assert pools.run(6) == [[7, 8, 9]] * 6
    assert len(pools.prefills["p1:1"].requests) == 6
    # Refused at most by the requests that had picked it before the first refusal came back.
    refused = len(pools.prefills["p0:1"].requests)
    assert 1 <= refused <= 3
    assert asyncio.run(pools.tokens()) == [7, 8, 9]
    assert len(pools.prefills["p0:1"].requests) == refused  # draining: no longer picked


def test_a_prefill_that_cannot_be_reached_is_retried_on_another() -> None:
    down = Prefill("p0:1", refuse=grpc.StatusCode.UNAVAILABLE, details="failed to connect to all addresses")
    pools = Pools([down, Prefill("p1:1")], [Decode("d0:1")])
    assert pools.run(4) == [[7, 8, 9]] * 4
    assert len(pools.prefills["p1:1"].requests) == 4
    tried = len(down.requests)
    assert 1 <= tried <= 2
    # Failing fast, it would look the least loaded and draw every pick: it is passed over a while.
    assert pools.run(4) == [[7, 8, 9]] * 4
    assert len(down.requests) == tried


def test_a_decode_refusing_before_its_first_token_is_retried_on_another_with_the_same_kv() -> None:
    pools = Pools([Prefill("p0:1")], [Decode("d0:1", refuse=grpc.StatusCode.UNAVAILABLE), Decode("d1:1")])
    assert pools.run(4) == [[7, 8, 9]] * 4
    assert len(pools.decodes["d1:1"].requests) == 4
    refused = pools.decodes["d0:1"].requests
    assert refused and {r.kv_cache.handle.lease_id for r in refused} <= {
        r.kv_cache.handle.lease_id for r in pools.decodes["d1:1"].requests
    }
    assert pools.leases.released == {}


def test_when_every_decode_refuses_the_kv_lease_is_released_at_its_prefill() -> None:
    pools = Pools(
        [Prefill("p0:1"), Prefill("p1:1")],
        [Decode("d0:1", refuse=grpc.StatusCode.INTERNAL), Decode("d1:1", refuse=grpc.StatusCode.INTERNAL)],
    )

    async def go() -> None:
        for text in ("one", "two", "three"):  # three conversations: their prefills by affinity
            with pytest.raises(Exception, match="decode"):
                _ = [r async for r in pools.router.generate(image_request(1, text=text))]

    asyncio.run(go())
    issued = {p.address: {f"{p.address}/kv{i + 1}" for i in range(len(p.requests))} for p in pools.prefills.values()}
    assert pools.leases.released == {a: leases for a, leases in issued.items() if leases}  # each at its producer
    assert sum(len(leases) for leases in issued.values()) == 3


def test_an_incompatible_member_is_skipped_and_the_decode_check_names_the_prefill() -> None:
    pools = Pools([Prefill("p0:1"), Prefill("p1:1")], [Decode("d0:1"), Decode("d1:1")])

    async def check_prefill(address: str) -> None:
        pools.checked.append(("prefill", address))
        if address == "p0:1":
            raise FailedPrecondition("peer p0:1 serves another model")

    async def check_decode(address: str, prefill: str) -> None:
        pools.checked.append(("decode", address, prefill))

    pools.checks.on_prefill, pools.checks.on_decode = check_prefill, check_decode
    assert pools.run(4) == [[7, 8, 9]] * 4
    assert not pools.prefills["p0:1"].requests and len(pools.prefills["p1:1"].requests) == 4
    assert {c for c in pools.checked if c[0] == "decode"} == {("decode", "d0:1", "p1:1"), ("decode", "d1:1", "p1:1")}


def test_pd_pool_spreads_and_retries_a_refusal_before_the_first_token() -> None:
    calls: Counter[str] = Counter()

    class PD:
        def __init__(self, address: str, refuse: bool = False) -> None:
            self.address, self.refuse = address, refuse

        def PrefillDecode(self, request: Any, timeout: float | None = None, **kw: Any) -> StreamCall:
            calls[self.address] += 1

            async def stream() -> AsyncIterator[Any]:
                if self.refuse:
                    raise rpc_error(grpc.StatusCode.UNAVAILABLE, DRAINING)
                await asyncio.sleep(0.02)
                for token in (5, 6):
                    yield prefill_decode_pb2.PrefillDecodeResponse(chunk=generation_pb2.TokenChunk(token_ids=[token]))

            return StreamCall(stream())

    members = {"pd0:1": PD("pd0:1"), "pd1:1": PD("pd1:1"), "pd2:1": PD("pd2:1", refuse=True)}
    log: list[tuple[str, int]] = []
    router = Router(
        StageStubs(
            encoder=lambda a: Encoder(a, log),
            lease=Leases().stub,
            checks=PassingChecks(),
            prefill_decode=members.__getitem__,
        ),
        EncoderPool(["e"]),
        stages=Stages(pd=MemberPool(list(members), stage="pd")),
    )

    async def go() -> list[list[int]]:
        async def one() -> list[int]:
            return [t async for r in router.generate(image_request(1)) for t in r.chunk.token_ids]

        return list(await asyncio.gather(*(one() for _ in range(9))))

    assert asyncio.run(go()) == [[5, 6]] * 9
    # One conversation, nine at once: its member takes them while it is at most 1.5x the other's
    # load plus one (services/router/pool.py, AFFINITY_LOAD); the rest go to the other.
    assert calls["pd0:1"] >= 3 and calls["pd1:1"] >= 3 and calls["pd0:1"] + calls["pd1:1"] == 9
    assert 1 <= calls["pd2:1"] <= 3


def test_a_conversation_keeps_its_member_within_a_bounded_load() -> None:
    pool = MemberPool(["a", "b", "c"], stage="pd")
    keys = [conversation_key(image_request(1, text=f"conversation {i}")) for i in range(60)]
    owners = [pool.pick_affine(key) for key in keys]
    assert owners == [pool.pick_affine(key) for key in keys]  # the same member every time
    assert set(owners) == {"a", "b", "c"}  # keys spread over the members
    key, owner = keys[0], owners[0]
    other = next(a for a in pool.outstanding if a != owner)
    pool.begin(owner)
    assert pool.pick_affine(key) == owner  # busier, within the bound
    for _ in range(3):
        pool.begin(owner)
    assert pool.pick_affine(key) != owner  # past 1.5x the least loaded plus one: the least loaded
    assert pool.pick_affine(key, exclude={owner}) != owner
    pool.update([a for a in pool.outstanding if a != other])  # another member leaves
    assert all(pool.pick_affine(k) == o for k, o in zip(keys, owners, strict=True) if o != other and o != owner)


def test_a_conversations_turns_share_a_key_that_its_tenant_and_media_change() -> None:
    first = image_request(1, text="what is it")
    later = generate_pb2.GenerateRequest()
    later.CopyFrom(first)
    later.messages.add(role=chat_pb2.CHAT_ROLE_ASSISTANT).parts.add(text="a square")
    later.messages.add(role=chat_pb2.CHAT_ROLE_USER).parts.add(text="what colour")
    assert conversation_key(later) == conversation_key(first)
    salted = generate_pb2.GenerateRequest()
    salted.CopyFrom(first)
    salted.cache_salt = "tenant-b"
    assert conversation_key(salted) != conversation_key(first)
    assert conversation_key(image_request(1, text="what is it", same=True)) == conversation_key(first)
    other_image = image_request(2, text="what is it")
    assert conversation_key(other_image) != conversation_key(first)


def test_a_conversation_moved_by_load_stays_where_its_last_turn_went() -> None:
    pool = MemberPool(["a", "b"], stage="pd")
    key = conversation_key(image_request(1, text="moved"))
    owner = pool.pick_affine(key)
    for _ in range(3):
        pool.begin(owner)
    moved = pool.pick_affine(key)
    assert moved != owner
    for _ in range(3):
        pool.end(owner)
    assert pool.pick_affine(key) == moved  # its prefix is there now, not where it started
