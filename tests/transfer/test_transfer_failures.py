"""Failure paths with dedicated producer processes: slot reuse under pressure, pool exhaustion, dead,
restarted and frozen peers (READ timeout -> quarantine). Each must end in a typed error, fast."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest

from libs.transfer import (
    PeerUnavailable,
    StaleHandle,
    TensorConsumer,
    TransferAgent,
    TransferConfig,
    TransferTimeout,
)
from tests.support.transfer_peer import MiB, PeerError, PeerProcess, Resolver, digest

pytestmark = pytest.mark.integration

# A fetch deadline past every test's limit here: a fetch that returns was answered by the transport.
NEVER_S = 3600.0


@pytest.fixture
def peers() -> Iterator[list[PeerProcess]]:
    """Producer processes a test starts; all stopped (killed if needed) afterwards."""
    started: list[PeerProcess] = []
    yield started
    for peer in started:
        peer.stop()


@pytest.mark.timeout(60)
def test_unacked_slots_survive_allocation_pressure(
    peers: list[PeerProcess], consumer_agent: TransferAgent, resolver: Resolver
) -> None:
    small = PeerProcess.start(pool_bytes=8 * MiB, poison_freed=True, checksum=True, huge_pages=False)
    peers.append(small)
    resolver.add(small)
    consumer = TensorConsumer(consumer_agent, resolver)
    held = [small.put([("embeddings", (MiB // 4, 4), "uint8")], seed=20 + i) for i in range(3)]

    # The producer allocates until its pool is full, scribbles 0x5A over every slot it got and frees
    # it (poisoning it again), 50 times. It must never be handed a slot that is still leased.
    exhausted = small.call("pressure", 256 * 1024, 50)
    assert exhausted == 50

    received = consumer.fetch_many([p.handle for p in held])
    try:
        for result, published in zip(received, held, strict=True):
            assert digest(result["embeddings"]) == published.digests["embeddings"]
        assert small.wait_leases_settled()["leases"]["acked"] == 3
        # Acked slots are reused (and poisoned) by the producer; our copies are our own memory.
        small.call("pressure", 256 * 1024, 5)
        for result, published in zip(received, held, strict=True):
            assert digest(result["embeddings"]) == published.digests["embeddings"]
    finally:
        for result in received:
            result.release()
    assert consumer_agent.pool.stats().empty


@pytest.mark.timeout(60)
def test_producer_pool_exhaustion_is_resource_exhausted(peers: list[PeerProcess]) -> None:
    small = PeerProcess.start(pool_bytes=8 * MiB, huge_pages=False)
    peers.append(small)
    kept = small.put([("embeddings", (6 * MiB,), "uint8")], seed=30)
    with pytest.raises(PeerError) as info:
        small.put([("embeddings", (4 * MiB,), "uint8")], seed=31)
    assert (info.value.type_name, info.value.grpc_code) == ("PoolExhausted", "RESOURCE_EXHAUSTED")
    assert small.call("release", [kept.handle.lease_id]) == 1
    small.put([("embeddings", (4 * MiB,), "uint8")], seed=31)  # room again once released


@pytest.mark.timeout(60)
def test_dead_peer_fails_fast_whether_or_not_it_was_contacted(
    peers: list[PeerProcess], consumer_agent: TransferAgent
) -> None:
    resolver = Resolver()
    contacted, never_contacted = PeerProcess.start(pool_bytes=16 * MiB), PeerProcess.start(pool_bytes=16 * MiB)
    peers += [contacted, never_contacted]
    resolver.add(contacted)
    resolver.add(never_contacted)
    consumer = TensorConsumer(consumer_agent, resolver)
    with consumer.fetch(contacted.put([("e", (1024,), "float32")], seed=40).handle):
        pass  # connection established
    orphans = [
        contacted.put([("e", (MiB,), "float32")], seed=41).handle,
        never_contacted.put([("e", (MiB,), "float32")], seed=42).handle,
    ]
    contacted.kill()
    never_contacted.kill()
    for handle in orphans:
        # Our deadline lies past the test's own limit: an answer at all is the transport's, telling
        # that the peer is gone (a deadline would be TransferTimeout, DEADLINE_EXCEEDED).
        with pytest.raises(PeerUnavailable) as info:
            consumer.fetch(handle, timeout_s=NEVER_S)
        assert info.value.grpc_code == grpc.StatusCode.UNAVAILABLE
    assert consumer_agent.pool.stats().empty


@pytest.mark.timeout(60)
def test_restarted_peer_is_refetched_and_old_handles_are_refused(
    peers: list[PeerProcess], consumer_agent: TransferAgent
) -> None:
    address = "127.0.0.1:50051"  # both incarnations serve this address
    current: dict[str, bytes] = {}
    calls: list[str] = []

    def by_address(ref: object) -> bytes:
        calls.append(ref.agent_name)  # type: ignore[attr-defined]
        return current[address]

    consumer = TensorConsumer(consumer_agent, by_address)
    first = PeerProcess.start(pool_bytes=16 * MiB)
    peers.append(first)
    current[address] = first.metadata
    with consumer.fetch(first.put([("e", (256,), "float32")], seed=50).handle):
        pass
    leftover = first.put([("e", (256,), "float32")], seed=51).handle
    first.kill()

    second = PeerProcess.start(pool_bytes=16 * MiB)
    peers.append(second)
    current[address] = second.metadata
    published = second.put([("e", (256,), "float32")], seed=52)
    with consumer.fetch(published.handle) as received:
        assert digest(received["e"]) == published.digests["e"]
    assert calls == [first.agent_info.agent_name, second.agent_info.agent_name]

    # Answered by the transport, not by our deadline (past the test's limit).
    with pytest.raises((PeerUnavailable, StaleHandle)):  # the dead incarnation's connection fails
        consumer.fetch(leftover, timeout_s=NEVER_S)
    with pytest.raises(StaleHandle):  # re-resolving finds the new incarnation: the handle is stale
        consumer.fetch(leftover, timeout_s=NEVER_S)
    assert consumer_agent.pool.stats().empty


@pytest.mark.timeout(60)
def test_read_from_a_frozen_peer_times_out_and_quarantines_the_slot(peers: list[PeerProcess]) -> None:
    frozen = PeerProcess.start(pool_bytes=16 * MiB)
    peers.append(frozen)
    resolver = Resolver()
    resolver.add(frozen)
    # Over TCP a READ needs the peer's progress (cross-memory attach does not): freezing the peer
    # leaves the READ in flight forever, which only our deadline ends.
    config = TransferConfig(pool_bytes=8 * MiB, huge_pages=False, quarantine_s=1.0, extra_env=(("UCX_TLS", "tcp"),))
    with TransferAgent(config) as agent:
        consumer = TensorConsumer(agent, resolver)
        warm = frozen.put([("e", (1024,), "float32")], seed=60)
        with consumer.fetch(warm.handle) as received:
            assert digest(received["e"]) == warm.digests["e"]
        stuck = frozen.put([("e", (MiB,), "float32")], seed=61)
        frozen.freeze()
        started = time.monotonic()
        with pytest.raises(TransferTimeout) as info:
            consumer.fetch(stuck.handle, timeout_s=0.5)
        # Ended by our deadline, never before it (and not never: the test's own limit).
        assert time.monotonic() - started >= 0.5
        assert info.value.grpc_code == grpc.StatusCode.DEADLINE_EXCEEDED
        stats = agent.pool.stats()
        assert (stats.slots_in_use, stats.quarantined_slots) == (0, 1)
        assert stats.largest_free_bytes < agent.pool.capacity  # the slot is not handed out again

        frozen.thaw()
        deadline = time.monotonic() + 30  # 1 s of quarantine, then the thawed peer's answer (a loaded host)
        while not agent.pool.stats().empty and time.monotonic() < deadline:
            time.sleep(0.05)
        assert agent.pool.stats().empty  # released once the quarantine period passed
        again = frozen.put([("e", (MiB,), "float32")], seed=62)
        with consumer.fetch(again.handle) as received:  # the peer is usable again once thawed
            assert digest(received["e"]) == again.digests["e"]
    # The timed-out lease was never acked; the producer reclaims it itself (here: by release).
    assert frozen.call("release", [stuck.handle.lease_id]) == 1
