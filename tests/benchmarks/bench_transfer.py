"""Benchmark of the tensor transport (not a pytest test; run by hand, prints one report).

    .venv/bin/python tests/benchmarks/bench_transfer.py [--reps 7] [--idle-s 10]

Measures, with a producer in another process and the consumer here:
- NIXL fetch of 1, 16, 64, 256 MiB (one tensor, random data): time of `TensorConsumer.fetch` (validate,
  READ, ack, tensor views), against a memcpy of the same bytes between two distinct committed pool
  buffers in this process, and against the same bytes sent INLINE in a gRPC response by a real server
  on 127.0.0.1 in a third process (call + parse + tensor view). Every timed operation (memcpy, fetch,
  inline call) runs the same way: its source was just written (the producer's `put`; for memcpy a
  fresh fill of the source buffer), then this process sweeps a scratch buffer of 3x the last-level
  cache, so data and code start cold, as for a service whose fetch follows other work. Median and
  best of `--reps` runs of each, ratios median/median and best/best;
- the same fetches back to back with nothing in between (handles published beforehand; caches
  warm, as in a busy consumer), against memcpy of the same two buffers repeated (cache-hot);
- latency of a 64 KiB fetch, back to back (median and p99);
- idle CPU of a process holding an agent (the producer, and this process), over `--idle-s` seconds.
- multi-host: the same cold fetches with producer and consumer in two network namespaces joined by
  veths and a bridge, UCX on TCP (no shared memory, no cross-memory attach), beside the memcpy and
  inline gRPC figures above (`--no-multihost` skips it; it needs root).
Goals (issue 4): >= 0.7x memcpy at >= 16 MiB, <= 0.4x the inline-gRPC time.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from concurrent import futures
from multiprocessing.connection import Connection
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import grpc  # noqa: E402
import numpy as np  # noqa: E402

from libs.contract.epd.v1 import tensor_pb2  # noqa: E402
from libs.transfer import TensorConsumer, TransferAgent, TransferConfig  # noqa: E402
from libs.transfer.pool import MemoryPool  # noqa: E402
from tests.support.transfer_peer import PeerProcess  # noqa: E402

MiB = 1 << 20
SIZES_MIB = (1, 16, 64, 256)
_METHOD = "/epd.bench.InlineBench/Get"
_UNLIMITED = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


# --- inline gRPC server (third process) ----------------------------------------------------------


def _serve_inline(conn: Connection) -> None:
    """Answers a TensorSpec(nbytes=N) with an INLINE TensorHandle carrying N random bytes."""
    rng = np.random.default_rng(0)
    cache: dict[int, tensor_pb2.TensorHandle] = {}

    def get(request: tensor_pb2.TensorSpec, context: object) -> tensor_pb2.TensorHandle:
        if request.nbytes not in cache:
            data = rng.integers(0, 256, request.nbytes, dtype=np.uint8).tobytes()
            handle = tensor_pb2.TensorHandle(transport=tensor_pb2.TRANSPORT_KIND_INLINE, lease_id="inline")
            handle.tensors.add(
                name="embeddings",
                spec=tensor_pb2.TensorSpec(
                    shape=[request.nbytes],
                    dtype=tensor_pb2.D_TYPE_UINT8,
                    nbytes=request.nbytes,
                    layout=tensor_pb2.TENSOR_LAYOUT_ROW_MAJOR,
                ),
                inline_data=data,
            )
            cache.clear()
            cache[request.nbytes] = handle
        return cache[request.nbytes]

    handler = grpc.method_handlers_generic_handler(
        "epd.bench.InlineBench",
        {
            "Get": grpc.unary_unary_rpc_method_handler(
                get,
                request_deserializer=tensor_pb2.TensorSpec.FromString,
                response_serializer=tensor_pb2.TensorHandle.SerializeToString,
            )
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=_UNLIMITED)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    conn.send(port)
    conn.recv()  # any message: stop
    server.stop(0)


# --- measurements --------------------------------------------------------------------------------


# Swept before each cold measurement: 3x the L3 of the hosts this runs on (32 MiB), so neither the
# bytes to copy nor the code that copies them are still cached.
_SCRATCH_BYTES = 96 * MiB


class Timings:
    """Seconds of repeated runs of one measurement."""

    def __init__(self, times: list[float]) -> None:
        self.times = times

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def best(self) -> float:
        return min(self.times)


class Cache:
    def __init__(self) -> None:
        self._scratch = np.zeros(_SCRATCH_BYTES, dtype=np.uint8)

    def evict(self) -> None:
        np.add(self._scratch, 1, out=self._scratch)


def memcpy_seconds(nbytes: int, reps: int, cache: Cache) -> tuple[Timings, Timings]:
    """(cold, hot): cold runs refill the source and sweep the cache first (as a fetch's source is
    freshly written by the producer); hot runs repeat the copy between the same buffers."""
    src_pool, dst_pool = MemoryPool(nbytes), MemoryPool(nbytes)
    src = np.frombuffer(src_pool.buffer, dtype=np.uint8, count=nbytes)
    dst = np.frombuffer(dst_pool.buffer, dtype=np.uint8, count=nbytes)
    fresh = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
    cold, hot = [], []
    for i in range(reps + 1):
        np.copyto(src, fresh)
        cache.evict()
        started = time.perf_counter()
        np.copyto(dst, src)
        if i:  # the first run also faults the destination's page tables in: not counted
            cold.append(time.perf_counter() - started)
    for _ in range(reps):
        started = time.perf_counter()
        np.copyto(dst, src)
        hot.append(time.perf_counter() - started)
    del src, dst
    src_pool.close()
    dst_pool.close()
    return Timings(cold), Timings(hot)


def nixl_seconds(peer: PeerProcess, consumer: TensorConsumer, nbytes: int, reps: int, cache: Cache) -> Timings:
    """Cold: the producer has just written the tensor (`put`), then the cache is swept."""
    times = []
    for i in range(reps + 1):  # the first run also connects: not counted
        handle = peer.put([("embeddings", (nbytes,), "uint8")], seed=i).handle
        peer.wait_leases_settled()  # the previous fetch's ack, so nothing else is in flight
        cache.evict()
        started = time.perf_counter()
        received = consumer.fetch(handle)
        times.append(time.perf_counter() - started)
        received.release()
    peer.wait_leases_settled()
    return Timings(times[1:])


def nixl_back_to_back_seconds(peer: PeerProcess, consumer: TensorConsumer, nbytes: int, reps: int) -> Timings:
    """Warm: handles published beforehand (they fit the pool: reps * nbytes), fetched one after another."""
    handles = [peer.put([("embeddings", (nbytes,), "uint8")], seed=i).handle for i in range(reps + 1)]
    times = []
    for handle in handles:
        started = time.perf_counter()
        consumer.fetch(handle).release()
        times.append(time.perf_counter() - started)
    peer.wait_leases_settled()
    return Timings(times[1:])


def inline_seconds(
    stub: grpc.UnaryUnaryMultiCallable, consumer: TensorConsumer, nbytes: int, reps: int, cache: Cache
) -> Timings:
    request = tensor_pb2.TensorSpec(nbytes=nbytes)
    stub(request)  # warm the server's cache and the channel
    times = []
    for _ in range(reps):
        cache.evict()
        started = time.perf_counter()
        handle = stub(request)
        received = consumer.fetch(handle)
        times.append(time.perf_counter() - started)
        received.release()
    return Timings(times)


def latency_64k(peer: PeerProcess, consumer: TensorConsumer, count: int) -> tuple[float, float]:
    handles = [peer.put([("embeddings", (64 * 1024,), "uint8")], seed=i).handle for i in range(count)]
    times = []
    for handle in handles:
        started = time.perf_counter()
        consumer.fetch(handle).release()
        times.append(time.perf_counter() - started)
    times.sort()
    return statistics.median(times), times[int(0.99 * (len(times) - 1))]


def multihost_rows(reps: int, copy_cold: dict[int, Timings], inline: dict[int, Timings]) -> None:
    """NIXL between two hosts: producer and consumer in network namespaces of their own, joined by
    veths and a bridge, UCX on TCP over them (UCX_TLS=tcp, UCX_NET_DEVICES=eth0: no shared memory,
    no cross-memory attach). Ratios against this run's loopback memcpy and inline gRPC."""
    import threading

    from tests.support.netns import NamespacesUnavailable, Topology, enter

    try:
        topology = Topology(["producer", "consumer"])
    except NamespacesUnavailable as exc:
        print(f"multi-host: not measured: {exc}")
        return
    pool_bytes = (max(SIZES_MIB) + 16) * MiB
    tcp = {"ucx_net_devices": "eth0", "extra_env": (("UCX_TLS", "tcp"),)}
    rows: list[tuple[int, Timings]] = []
    errors: list[BaseException] = []
    with topology:
        peer = PeerProcess.start(netns=topology.namespace("producer"), pool_bytes=pool_bytes, **tcp)

        def consume() -> None:  # this thread (and the agent threads it starts) in the consumer host
            try:
                enter(topology.namespace("consumer"))
                config = TransferConfig(pool_bytes=pool_bytes, transfer_timeout_s=60, **tcp)
                with TransferAgent(config) as agent:
                    consumer = TensorConsumer(agent, lambda ref: peer.metadata)
                    cache = Cache()
                    for size_mib in SIZES_MIB:
                        rows.append((size_mib, nixl_seconds(peer, consumer, size_mib * MiB, reps, cache)))
            except BaseException as exc:  # reported below, from the main thread
                errors.append(exc)

        try:
            thread = threading.Thread(target=consume, name="multihost-consumer")
            thread.start()
            thread.join()
        finally:
            peer.stop()
    if errors:
        raise errors[0]
    print(
        f"multi-host: NIXL fetch between network namespaces {topology.address('producer')} -> "
        f"{topology.address('consumer')} (veth + bridge), UCX_TLS=tcp UCX_NET_DEVICES=eth0; cold, median (best)"
    )
    for size_mib, nixl in rows:
        nbytes = size_mib * MiB
        print(
            f"{size_mib:>5} MiB | NIXL/TCP {nixl.median * 1e3:8.2f} ({nixl.best * 1e3:8.2f}) ms "
            f"{nbytes / nixl.median / 1e9:5.2f} GB/s | memcpy {copy_cold[size_mib].median * 1e3:6.2f} ms "
            f"({copy_cold[size_mib].median / nixl.median:5.2f}x) | inline gRPC on loopback "
            f"{inline[size_mib].median * 1e3:8.2f} ms (NIXL/inline {nixl.median / inline[size_mib].median:5.2f}x)"
        )


def own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=7, help="runs per size (median and best reported)")
    parser.add_argument("--latency-count", type=int, default=200, help="64 KiB fetches for the latency figure")
    parser.add_argument("--idle-s", type=float, default=10.0, help="idle CPU measurement window, seconds")
    parser.add_argument(
        "--multihost",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also NIXL over TCP between two network namespaces (needs root)",
    )
    args = parser.parse_args()

    pool_bytes = (max(SIZES_MIB) + 16) * MiB  # also holds 8 x 16 MiB back to back
    peer = PeerProcess.start(pool_bytes=pool_bytes)
    ctx = multiprocessing.get_context("spawn")
    server_conn, child_conn = ctx.Pipe()
    server = ctx.Process(target=_serve_inline, args=(child_conn,), daemon=True)
    server.start()
    try:
        port = server_conn.recv()
        config = TransferConfig(
            pool_bytes=pool_bytes, inline_max_bytes=pool_bytes, transfer_timeout_s=30, accept_inline=True
        )
        with TransferAgent(config) as agent, grpc.insecure_channel(f"127.0.0.1:{port}", options=_UNLIMITED) as channel:
            consumer = TensorConsumer(agent, lambda ref: peer.metadata)
            stub = channel.unary_unary(
                _METHOD,
                request_serializer=tensor_pb2.TensorSpec.SerializeToString,
                response_deserializer=tensor_pb2.TensorHandle.FromString,
            )
            print(
                f"tensor transport benchmark: {args.reps} runs per size, median (best); cold = source just "
                f"written, cache swept before each run; host has {os.cpu_count()} CPUs, load average "
                f"{os.getloadavg()[0]:.2f} / {os.getloadavg()[1]:.2f} (1 / 5 min)"
            )
            header = (
                f"{'size':>8} | {'memcpy cold':>17} | {'NIXL fetch cold':>26} | {'vs memcpy':>13} | "
                f"{'inline gRPC':>20} | {'NIXL/inline':>11}"
            )
            print(header)
            print("-" * len(header))
            cache = Cache()
            warm_rows = []
            copy_cold: dict[int, Timings] = {}
            inline_times: dict[int, Timings] = {}
            for size_mib in SIZES_MIB:
                nbytes = size_mib * MiB
                copy, copy_hot = memcpy_seconds(nbytes, args.reps, cache)
                nixl = nixl_seconds(peer, consumer, nbytes, args.reps, cache)
                inline = inline_seconds(stub, consumer, nbytes, args.reps, cache)
                copy_cold[size_mib], inline_times[size_mib] = copy, inline
                print(
                    f"{size_mib:>5} MiB | {copy.median * 1e3:6.2f} ({copy.best * 1e3:6.2f}) ms | "
                    f"{nixl.median * 1e3:6.2f} ({nixl.best * 1e3:6.2f}) ms {nbytes / nixl.median / 1e9:5.1f} GB/s | "
                    f"{copy.median / nixl.median:5.2f}x ({copy.best / nixl.best:4.2f}x) | "
                    f"{inline.median * 1e3:8.2f} ms {nbytes / inline.median / 1e9:4.1f} GB/s | "
                    f"{nixl.median / inline.median:10.2f}x"
                )
                if nbytes * (args.reps + 1) <= pool_bytes:
                    warm_rows.append((size_mib, copy_hot, nixl_back_to_back_seconds(peer, consumer, nbytes, args.reps)))
            print(
                "back to back (caches warm): memcpy repeated between the same buffers, "
                "fetches of handles published beforehand"
            )
            for size_mib, copy_hot, warm in warm_rows:
                nbytes = size_mib * MiB
                print(
                    f"{size_mib:>5} MiB | memcpy {copy_hot.median * 1e3:6.2f} ({copy_hot.best * 1e3:6.2f}) ms | "
                    f"NIXL fetch {warm.median * 1e3:6.2f} ({warm.best * 1e3:6.2f}) ms "
                    f"{nbytes / warm.median / 1e9:5.1f} GB/s | "
                    f"{copy_hot.median / warm.median:5.2f}x ({copy_hot.best / warm.best:4.2f}x)"
                )
            median, p99 = latency_64k(peer, consumer, args.latency_count)
            print(
                f"64 KiB fetch latency: median {median * 1e6:.0f} us, p99 {p99 * 1e6:.0f} us "
                f"({args.latency_count} runs)"
            )
            if args.multihost:
                multihost_rows(args.reps, copy_cold, inline_times)

            peer.wait_leases_settled()
            time.sleep(0.5)
            peer_before, own_before, started = peer.cpu_seconds(), own_cpu_seconds(), time.monotonic()
            time.sleep(args.idle_s)
            elapsed = time.monotonic() - started
            peer_share = (peer.cpu_seconds() - peer_before) / elapsed
            own_share = (own_cpu_seconds() - own_before) / elapsed
            print(
                f"idle CPU over {elapsed:.1f} s: producer process {100 * peer_share:.2f}% of one core, "
                f"consumer process (this one, agent + gRPC channel) {100 * own_share:.2f}%"
            )
    finally:
        server_conn.send("stop")
        server.join(5)
        if server.is_alive():
            server.kill()
        peer.stop()


if __name__ == "__main__":
    main()
