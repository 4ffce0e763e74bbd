"""Fixtures of the transfer tests: a producer in another process, a consumer agent in this one.

Both are started once per session (a process start is slow) and checked after every test that
uses them: the consumer's pool must be back to empty and the producer must hold no lease, so a
test that leaks a slot fails itself, not a later one.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from libs.transfer import TensorConsumer, TransferAgent, TransferConfig
from tests.support.transfer_peer import MiB, PeerProcess, Resolver


@pytest.fixture(scope="session")
def producer_peer() -> Iterator[PeerProcess]:
    peer = PeerProcess.start(pool_bytes=300 * MiB, checksum=True, poison_freed=True)
    yield peer
    peer.stop()


@pytest.fixture(scope="session")
def consumer_agent() -> Iterator[TransferAgent]:
    # accept_inline: the inline transport's own tests run on this agent (refusal: test_lease_stamps).
    agent = TransferAgent(TransferConfig(pool_bytes=300 * MiB, poison_freed=True, accept_inline=True))
    yield agent
    agent.close()


@pytest.fixture
def resolver(producer_peer: PeerProcess) -> Resolver:
    resolver = Resolver()
    resolver.add(producer_peer)
    return resolver


@pytest.fixture
def consumer(consumer_agent: TransferAgent, resolver: Resolver, producer_peer: PeerProcess) -> Iterator[TensorConsumer]:
    yield TensorConsumer(consumer_agent, resolver)
    assert consumer_agent.pool.stats().empty, f"consumer slots leaked: {consumer_agent.pool.stats()}"
    stats = producer_peer.wait_leases_settled()
    assert stats["leases"]["active"] == 0, f"producer leases left: {stats['leases']}"
    assert stats["pool"]["slots_in_use"] == 0, f"producer slots left: {stats['pool']}"
