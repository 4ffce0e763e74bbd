"""What a consumer trusts of a handle, between two real processes. Lease stamps
(libs/transfer/stamp.py): a consumer tells a live lease from a made-up, released or reused one
without trusting the handle's other fields (each case also shows what a consumer that does not
check stamps would have done). Checksums: required when the producer says it attaches them.
INLINE handles: refused unless the consumer is configured to take them (authenticated callers)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from libs.contract.epd.v1 import tensor_pb2
from libs.transfer import (
    AgentMetadata,
    BadDescriptor,
    StaleHandle,
    TensorConsumer,
    TransferAgent,
    TransferConfig,
)
from libs.transfer.errors import InlineRefused
from tests.support.transfer_peer import PeerProcess, Published, digest

pytestmark = pytest.mark.integration

EMBEDDINGS = [("embeddings", (64, 32), "float32")]


@pytest.fixture
def stamped(consumer_agent: TransferAgent, producer_peer: PeerProcess) -> Iterator[TensorConsumer]:
    """A consumer that knows the producer stamps (as services learn from its ServiceInfo)."""
    yield TensorConsumer(consumer_agent, lambda ref: AgentMetadata(producer_peer.metadata, lease_stamps=True))
    assert consumer_agent.pool.stats().empty, f"consumer slots leaked: {consumer_agent.pool.stats()}"
    stats = producer_peer.wait_leases_settled()
    assert stats["leases"]["active"] == 0, f"producer leases left: {stats['leases']}"


def _without_checksums(handle: tensor_pb2.TensorHandle) -> tensor_pb2.TensorHandle:
    copy = tensor_pb2.TensorHandle()
    copy.CopyFrom(handle)
    for desc in copy.tensors:
        desc.ClearField("checksum")
    return copy


def _matches(received: object, published: Published) -> bool:
    tensors = received.tensors  # type: ignore[attr-defined]
    return all(digest(t) == published.digests[name] for name, t in tensors.items())


def test_a_live_lease_reads_as_before(producer_peer: PeerProcess, stamped: TensorConsumer) -> None:
    published = producer_peer.put(EMBEDDINGS, seed=1)
    with stamped.fetch(published.handle) as received:
        assert _matches(received, published)  # the stamp precedes the tensors, never inside them


def test_a_made_up_lease_id_over_live_regions_is_refused(producer_peer: PeerProcess, stamped: TensorConsumer) -> None:
    published = producer_peer.put(EMBEDDINGS, seed=2)
    forged = tensor_pb2.TensorHandle()
    forged.CopyFrom(published.handle)
    forged.lease_id = "made-up-lease"  # checksums copied too: they match the live bytes
    with pytest.raises(StaleHandle, match="made-up-lease is not held"):
        stamped.fetch(forged)
    # The real lease was not acked by the refused read: its owner still reads it.
    assert producer_peer.stats()["leases"]["active"] == 1
    with stamped.fetch(published.handle) as received:
        assert _matches(received, published)


def test_a_released_lease_without_checksums_is_refused(
    producer_peer: PeerProcess, stamped: TensorConsumer, consumer: TensorConsumer
) -> None:
    published = producer_peer.put(EMBEDDINGS, seed=3)
    assert producer_peer.call("release", [published.handle.lease_id]) == 1
    stale = _without_checksums(published.handle)
    # What a consumer without stamps does: reads the freed (poisoned) slot and returns it as data.
    with consumer.fetch(stale) as garbage:
        assert not _matches(garbage, published)
    with pytest.raises(StaleHandle, match="freed"):
        stamped.fetch(stale)


def test_a_slot_reused_for_another_lease_is_refused(producer_peer: PeerProcess, stamped: TensorConsumer) -> None:
    first = producer_peer.put(EMBEDDINGS, seed=4)
    assert producer_peer.call("release", [first.handle.lease_id]) == 1
    second = producer_peer.put(EMBEDDINGS, seed=5)
    assert second.handle.tensors[0].regions[0].address == first.handle.tensors[0].regions[0].address  # same slot
    with pytest.raises(StaleHandle, match="stamped for another lease"):
        stamped.fetch(_without_checksums(first.handle))
    with stamped.fetch(second.handle) as received:  # the new owner is unaffected
        assert _matches(received, second)


def test_regions_moved_off_their_lease_are_refused(producer_peer: PeerProcess, stamped: TensorConsumer) -> None:
    published = producer_peer.put(EMBEDDINGS, seed=6)
    moved = _without_checksums(published.handle)
    moved.tensors[0].regions[0].address += 256  # still inside the producer's registered pool
    with pytest.raises(StaleHandle):
        stamped.fetch(moved)
    assert producer_peer.call("release", [published.handle.lease_id]) == 1


def test_a_checksum_left_out_is_refused_when_the_producer_attaches_them(
    consumer_agent: TransferAgent, producer_peer: PeerProcess
) -> None:
    strict = TensorConsumer(
        consumer_agent, lambda ref: AgentMetadata(producer_peer.metadata, lease_stamps=True, checksums=True)
    )
    published = producer_peer.put(EMBEDDINGS, seed=7)
    with pytest.raises(BadDescriptor, match="lack the checksum"):
        strict.fetch(_without_checksums(published.handle))
    with strict.fetch(published.handle) as received:  # with them, as produced: fine
        assert _matches(received, published)
    assert consumer_agent.pool.stats().empty


def test_inline_handles_are_refused_unless_accepted(producer_peer: PeerProcess) -> None:
    published = producer_peer.put_inline(EMBEDDINGS, seed=8)
    agent = TransferAgent(TransferConfig(pool_bytes=1 << 20))  # the default: accept_inline=False
    try:
        with pytest.raises(InlineRefused, match="authenticated callers") as refused:
            TensorConsumer(agent, lambda ref: b"").fetch(published.handle)
        assert refused.value.grpc_code.name == "PERMISSION_DENIED"
    finally:
        agent.close()
