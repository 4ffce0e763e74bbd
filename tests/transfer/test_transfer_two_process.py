"""Producer in another process, consumer here: real NIXL READs of random data between two pools."""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc
import pytest
import torch

from libs.contract.epd.v1 import tensor_pb2
from libs.transfer import (
    BadDescriptor,
    DescriptorOutOfBounds,
    ExpectedTensor,
    InlineTooLarge,
    PeerUnavailable,
    PoolExhausted,
    SpecMismatch,
    StaleHandle,
    TensorConsumer,
    TransferAgent,
    TransferConfig,
)
from libs.transfer.agent import PendingRead, Range
from tests.support.transfer_peer import MiB, PeerError, PeerProcess, Published, Resolver, digest

pytestmark = pytest.mark.integration

KiB = 1 << 10


def assert_bit_exact(received: Any, published: Published) -> None:
    assert set(received.tensors) == set(published.digests)
    for name, tensor in received.tensors.items():
        assert digest(tensor) == published.digests[name], f"tensor {name} differs"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("nbytes", "dtype"),
    [(KiB, "float32"), (64 * KiB, "bfloat16"), (MiB, "int64"), (16 * MiB, "float16"), (256 * MiB, "uint8")],
    ids=["1KiB", "64KiB", "1MiB", "16MiB", "256MiB"],
)
def test_bit_exact_from_1kib_to_256mib(
    producer_peer: PeerProcess, consumer: TensorConsumer, nbytes: int, dtype: str
) -> None:
    itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    published = producer_peer.put([("embeddings", (nbytes // itemsize // 64, 64), dtype)], seed=nbytes)
    assert published.handle.tensors[0].checksum.algorithm == tensor_pb2.CHECKSUM_ALGORITHM_CRC32
    with consumer.fetch(published.handle) as received:
        tensor = received["embeddings"]
        assert tensor.dtype == getattr(torch, dtype)
        assert tensor.numel() * tensor.element_size() == nbytes
        assert tensor.count_nonzero() > 0
        assert_bit_exact(received, published)
        # No copy: the tensor's memory is the consumer's registered slot.
        pool = consumer.agent.pool
        assert pool.base_address <= tensor.data_ptr() < pool.base_address + pool.capacity
    stats = producer_peer.wait_leases_settled()
    assert stats["leases"]["acked"] >= 1 and stats["leases"]["active"] == 0


@pytest.mark.timeout(30)
def test_every_dtype_and_an_empty_tensor_in_one_handle(producer_peer: PeerProcess, consumer: TensorConsumer) -> None:
    requests = [
        ("f32", (3, 5), "float32"),
        ("f16", (7,), "float16"),
        ("bf16", (2, 2, 9), "bfloat16"),
        ("i64", (11,), "int64"),
        ("i32", (4, 4), "int32"),
        ("i8", (33,), "int8"),
        ("u8", (5, 5), "uint8"),
        ("mask", (17,), "bool"),
        ("empty", (0, 64), "float32"),
    ]
    published = producer_peer.put(requests, seed=7)
    with consumer.fetch(published.handle) as received:
        for name, shape, dtype in requests:
            assert received[name].shape == shape and received[name].dtype == getattr(torch, dtype)
        assert_bit_exact(received, published)


@pytest.mark.timeout(30)
def test_per_layer_kv_moves_in_one_read(
    producer_peer: PeerProcess, consumer: TensorConsumer, monkeypatch: pytest.MonkeyPatch
) -> None:
    layers = 24
    requests = [(f"layers.{i}.{kind}", (2, 37, 64), "bfloat16") for i in range(layers) for kind in ("key", "value")]
    published = producer_peer.put(requests, seed=11)
    reads: list[int] = []
    real_start = consumer.agent.start_read

    def spy(peer: str, local: list[Range], remote: list[Range]) -> PendingRead:
        reads.append(len(remote))
        return real_start(peer, local, remote)

    monkeypatch.setattr(consumer.agent, "start_read", spy)
    with consumer.fetch(published.handle) as received:
        assert_bit_exact(received, published)
    assert reads == [2 * layers]


@pytest.mark.timeout(30)
def test_fetch_many_posts_all_reads_and_returns_in_order(producer_peer: PeerProcess, consumer: TensorConsumer) -> None:
    items = [producer_peer.put([("embeddings", (100 + 13 * i, 256), "float32")], seed=100 + i) for i in range(8)]
    results = consumer.fetch_many([p.handle for p in items])
    try:
        for result, published in zip(results, items, strict=True):
            assert result.lease_id == published.handle.lease_id
            assert_bit_exact(result, published)
    finally:
        for result in results:
            result.release()


@pytest.mark.timeout(60)
def test_four_threads_transfer_concurrently(producer_peer: PeerProcess, consumer: TensorConsumer) -> None:
    per_thread = [
        [producer_peer.put([("t", ((64 * KiB) << (i % 6),), "uint8")], seed=1000 + 10 * t + i) for i in range(8)]
        for t in range(4)
    ]
    failures: list[str] = []
    start = threading.Barrier(4)

    def work(items: list[Published]) -> None:
        start.wait()
        for published in items:
            try:
                with consumer.fetch(published.handle) as received:
                    if digest(received["t"]) != published.digests["t"]:
                        failures.append(f"{published.handle.lease_id}: bytes differ")
            except Exception as exc:
                failures.append(f"{published.handle.lease_id}: {exc!r}")

    threads = [threading.Thread(target=work, args=(items,)) for items in per_thread]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(t.is_alive() for t in threads)
    assert failures == []


@pytest.mark.timeout(30)
def test_metadata_is_resolved_once_per_peer(
    producer_peer: PeerProcess, consumer: TensorConsumer, resolver: Resolver
) -> None:
    for i in range(3):
        with consumer.fetch(producer_peer.put([("e", (64,), "float32")], seed=i).handle):
            pass
    assert resolver.calls == 1


@pytest.mark.timeout(30)
def test_inline_transport_round_trip_and_bound(producer_peer: PeerProcess, consumer: TensorConsumer) -> None:
    published = producer_peer.put_inline([("embeddings", (50, 128), "bfloat16"), ("ids", (9,), "int64")], seed=5)
    assert published.handle.transport == tensor_pb2.TRANSPORT_KIND_INLINE
    with consumer.fetch(published.handle) as received:
        assert_bit_exact(received, published)
    with pytest.raises(PeerError) as info:
        producer_peer.put_inline([("big", (2 * MiB,), "uint8")], seed=1)
    assert (info.value.type_name, info.value.grpc_code) == ("InlineTooLarge", "RESOURCE_EXHAUSTED")
    oversized = tensor_pb2.TensorHandle()
    oversized.CopyFrom(published.handle)
    big = oversized.tensors.add(name="big", inline_data=b"\x01" * (2 * MiB))
    big.spec.CopyFrom(tensor_pb2.TensorSpec(shape=[2 * MiB], dtype=tensor_pb2.D_TYPE_UINT8, nbytes=2 * MiB, layout=1))
    with pytest.raises(InlineTooLarge):
        consumer.fetch(oversized)


@pytest.mark.timeout(30)
def test_spec_mismatch_is_refused_before_any_read(producer_peer: PeerProcess, consumer: TensorConsumer) -> None:
    published = producer_peer.put([("embeddings", (16, 1280), "bfloat16")], seed=3)
    wrong_width = {"embeddings": ExpectedTensor(tensor_pb2.D_TYPE_BFLOAT16, (None, 3584))}
    with pytest.raises(SpecMismatch) as info:
        consumer.fetch(published.handle, expected=wrong_width)
    assert info.value.grpc_code == grpc.StatusCode.FAILED_PRECONDITION
    assert producer_peer.stats()["leases"]["active"] == 1  # nothing was read, nothing acked
    right = {"embeddings": ExpectedTensor(tensor_pb2.D_TYPE_BFLOAT16, (None, 1280))}
    with consumer.fetch(published.handle, expected=right) as received:
        assert_bit_exact(received, published)


@pytest.mark.timeout(30)
def test_malformed_handle_is_invalid_argument(producer_peer: PeerProcess, consumer: TensorConsumer) -> None:
    published = producer_peer.put([("embeddings", (8, 8), "float32")], seed=4)
    broken = tensor_pb2.TensorHandle()
    broken.CopyFrom(published.handle)
    broken.tensors[0].spec.shape[0] = 9  # 9*8*4 bytes claimed, regions hold 8*8*4
    with pytest.raises(BadDescriptor) as info:
        consumer.fetch(broken)
    assert info.value.grpc_code == grpc.StatusCode.INVALID_ARGUMENT
    assert producer_peer.call("release", [published.handle.lease_id]) == 1


@pytest.mark.timeout(30)
@pytest.mark.parametrize("where", ["past_the_pool", "straddling_the_end", "before_the_pool"])
def test_out_of_bounds_regions_fail_fast(producer_peer: PeerProcess, consumer: TensorConsumer, where: str) -> None:
    published = producer_peer.put([("embeddings", (64, 64), "float32")], seed=6)
    pool = producer_peer.stats()["pool"]
    region = published.handle.tensors[0].regions[0]
    lowest_slot = region.address  # first slot of an otherwise empty pool starts at its base
    bad = tensor_pb2.TensorHandle()
    bad.CopyFrom(published.handle)
    bad_region = bad.tensors[0].regions[0]
    bad_region.address = {
        "past_the_pool": lowest_slot + pool["capacity_bytes"] + 4096,
        "straddling_the_end": lowest_slot + pool["capacity_bytes"] - region.length // 2,
        "before_the_pool": lowest_slot - 2 * MiB,
    }[where]
    with pytest.raises(DescriptorOutOfBounds) as info:  # refused by NIXL: our deadline is past the test's limit
        consumer.fetch(bad, timeout_s=3600)
    assert info.value.grpc_code == grpc.StatusCode.INVALID_ARGUMENT
    with consumer.fetch(published.handle) as received:  # the genuine handle still works
        assert_bit_exact(received, published)


@pytest.mark.timeout(30)
def test_unknown_agent_is_unavailable(producer_peer: PeerProcess, consumer: TensorConsumer) -> None:
    published = producer_peer.put([("embeddings", (4, 4), "float32")], seed=8)
    ghost = tensor_pb2.TensorHandle()
    ghost.CopyFrom(published.handle)
    ghost.agent.agent_name = "encoder-that-never-was"
    with pytest.raises(PeerUnavailable):  # the resolver has no metadata for it (our deadline: past the test's limit)
        consumer.fetch(ghost, timeout_s=3600)
    assert producer_peer.call("release", [published.handle.lease_id]) == 1


@pytest.mark.timeout(30)
def test_expired_lease_is_reclaimed_and_its_handle_is_stale(
    producer_peer: PeerProcess, consumer: TensorConsumer, monkeypatch: pytest.MonkeyPatch
) -> None:
    published = producer_peer.put([("embeddings", (256, 256), "float32")], seed=9, ttl_s=0.3)
    before = producer_peer.stats()["leases"]["expired"]
    stats = producer_peer.wait_leases_settled(timeout=30)
    assert stats["leases"]["expired"] == before + 1
    assert stats["pool"]["slots_in_use"] == 0
    reads: list[str] = []
    monkeypatch.setattr(consumer.agent, "start_read", lambda peer, *_: reads.append(peer))
    with pytest.raises(StaleHandle) as info:
        consumer.fetch(published.handle)
    assert reads == []  # refused from the handle's own expiry, before any read of reclaimed memory
    assert info.value.grpc_code == grpc.StatusCode.NOT_FOUND


@pytest.mark.timeout(30)
def test_consumer_pool_exhaustion_leaves_the_lease_to_the_producer(producer_peer: PeerProcess) -> None:
    resolver = Resolver()
    resolver.add(producer_peer)
    with TransferAgent(TransferConfig(pool_bytes=MiB, huge_pages=False)) as small:
        consumer = TensorConsumer(small, resolver)
        acked = producer_peer.wait_leases_settled()["leases"]["acked"]  # earlier acks in, before its lease
        published = producer_peer.put([("embeddings", (4 * MiB,), "uint8")], seed=10)
        with pytest.raises(PoolExhausted) as info:
            consumer.fetch(published.handle)
        assert info.value.grpc_code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert small.pool.stats().empty
        # Not acked, proven by order rather than by waiting: this agent's next ack to the producer
        # travels behind any earlier one, so once the producer has it, an ack of the failed fetch
        # would have arrived too.
        barrier = producer_peer.put([("embeddings", (KiB,), "uint8")], seed=11)
        consumer.fetch(barrier.handle).release()
        deadline = time.monotonic() + 30
        while (stats := producer_peer.stats())["leases"]["acked"] == acked and time.monotonic() < deadline:
            time.sleep(0.01)
    assert stats["leases"]["acked"] == acked + 1  # the barrier's ack, and only it
    assert stats["leases"]["active"] == 1  # the producer still holds the lease of the failed fetch
    assert producer_peer.call("release", [published.handle.lease_id]) == 1


@pytest.mark.timeout(30)
def test_acks_go_out_from_the_service_thread_and_on_close(producer_peer: PeerProcess) -> None:
    # `fetch` queues the ack for the agent's service thread; one still queued when the agent closes
    # is sent by close(), so the producer frees the lease at once instead of at its expiry.
    resolver = Resolver()
    resolver.add(producer_peer)
    acked_before = producer_peer.wait_leases_settled()["leases"]["acked"]
    with TransferAgent(TransferConfig(pool_bytes=4 * MiB)) as agent:
        consumer = TensorConsumer(agent, resolver)
        for seed in range(3):
            published = producer_peer.put([("embeddings", (64 * KiB,), "uint8")], seed=seed)
            with consumer.fetch(published.handle) as received:
                assert_bit_exact(received, published)
        assert producer_peer.wait_leases_settled()["leases"]["acked"] == acked_before + 3
        published = producer_peer.put([("embeddings", (64 * KiB,), "uint8")], seed=3)
        consumer.fetch(published.handle).release()
    stats = producer_peer.wait_leases_settled()
    assert stats["leases"]["acked"] == acked_before + 4 and stats["leases"]["active"] == 0


# The module's last test: its limit also covers stopping the module's peer processes, which a loaded
# host stretches well past the test itself (seen: 50 s).
@pytest.mark.timeout(180)
def test_idle_agent_uses_almost_no_cpu(producer_peer: PeerProcess) -> None:
    producer_peer.wait_leases_settled()
    before, started = producer_peer.cpu_seconds(), time.monotonic()
    time.sleep(2.0)
    share = (producer_peer.cpu_seconds() - before) / (time.monotonic() - started)
    print(f"idle producer process CPU: {100 * share:.2f}% of one core")
    assert share < 0.05
