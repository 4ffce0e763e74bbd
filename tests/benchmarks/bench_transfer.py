"""Benchmark of the tensor transport (not a pytest test; run by hand, prints one report).

    .venv/bin/python tests/benchmarks/bench_transfer.py [--reps 5] [--idle-s 10]

Measures, with a producer in another process and the consumer here:
- NIXL fetch of 1, 16, 64, 256 MiB (one tensor, random data): time of `TensorConsumer.fetch` (validate,
  READ, ack, tensor views), as a throughput ratio to a memcpy of the same bytes between two committed
  pool buffers in this process, and as a time ratio to the same bytes sent INLINE in a gRPC response
  by a real server on 127.0.0.1 in a third process (call + parse + tensor view);
- latency of a 64 KiB fetch (median and p99);
- idle CPU of a process holding an agent (the producer, and this process), over `--idle-s` seconds.
Medians over `--reps` runs. Goals (issue 4): >= 0.7x memcpy at >= 16 MiB, <= 0.4x the inline-gRPC time.
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
from tests.transfer.peer import PeerProcess  # noqa: E402

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


def memcpy_seconds(nbytes: int, reps: int) -> float:
    src_pool, dst_pool = MemoryPool(nbytes), MemoryPool(nbytes)
    src = np.frombuffer(src_pool.buffer, dtype=np.uint8, count=nbytes)
    dst = np.frombuffer(dst_pool.buffer, dtype=np.uint8, count=nbytes)
    src[:] = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
    times = []
    for _ in range(reps + 1):
        started = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - started)
    del src, dst
    src_pool.close()
    dst_pool.close()
    return min(times[1:])  # memcpy: best run, so noise from other processes cannot flatter the ratios


def nixl_seconds(peer: PeerProcess, consumer: TensorConsumer, nbytes: int, reps: int) -> tuple[float, float]:
    times = []
    for i in range(reps + 1):  # the first run also connects: not counted
        handle = peer.put([("embeddings", (nbytes,), "uint8")], seed=i).handle
        started = time.perf_counter()
        received = consumer.fetch(handle)
        times.append(time.perf_counter() - started)
        received.release()
        peer.wait_leases_settled()
    return statistics.median(times[1:]), min(times[1:])


def inline_seconds(stub: grpc.UnaryUnaryMultiCallable, consumer: TensorConsumer, nbytes: int, reps: int) -> float:
    request = tensor_pb2.TensorSpec(nbytes=nbytes)
    stub(request)  # warm the server's cache and the channel
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        handle = stub(request)
        received = consumer.fetch(handle)
        times.append(time.perf_counter() - started)
        received.release()
    return statistics.median(times)


def latency_64k(peer: PeerProcess, consumer: TensorConsumer, count: int) -> tuple[float, float]:
    handles = [peer.put([("embeddings", (64 * 1024,), "uint8")], seed=i).handle for i in range(count)]
    times = []
    for handle in handles:
        started = time.perf_counter()
        consumer.fetch(handle).release()
        times.append(time.perf_counter() - started)
    times.sort()
    return statistics.median(times), times[int(0.99 * (len(times) - 1))]


def own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5, help="runs per size (median reported)")
    parser.add_argument("--latency-count", type=int, default=200, help="64 KiB fetches for the latency figure")
    parser.add_argument("--idle-s", type=float, default=10.0, help="idle CPU measurement window, seconds")
    args = parser.parse_args()

    pool_bytes = (max(SIZES_MIB) + 16) * MiB
    peer = PeerProcess.start(pool_bytes=pool_bytes)
    ctx = multiprocessing.get_context("spawn")
    server_conn, child_conn = ctx.Pipe()
    server = ctx.Process(target=_serve_inline, args=(child_conn,), daemon=True)
    server.start()
    try:
        port = server_conn.recv()
        config = TransferConfig(pool_bytes=pool_bytes, inline_max_bytes=pool_bytes, transfer_timeout_s=30)
        with TransferAgent(config) as agent, grpc.insecure_channel(f"127.0.0.1:{port}", options=_UNLIMITED) as channel:
            consumer = TensorConsumer(agent, lambda ref: peer.metadata)
            stub = channel.unary_unary(
                _METHOD,
                request_serializer=tensor_pb2.TensorSpec.SerializeToString,
                response_deserializer=tensor_pb2.TensorHandle.FromString,
            )
            print(
                f"tensor transport benchmark: {args.reps} runs per size; memcpy best run, NIXL median (best), "
                f"inline median; host has {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
            )
            header = (
                f"{'size':>8} | {'memcpy':>14} | {'NIXL fetch median':>22} | {'vs memcpy (best)':>16} | "
                f"{'inline gRPC':>22} | {'NIXL/inline time':>16}"
            )
            print(header)
            print("-" * len(header))
            for size_mib in SIZES_MIB:
                nbytes = size_mib * MiB
                copy = memcpy_seconds(nbytes, args.reps)
                nixl, nixl_best = nixl_seconds(peer, consumer, nbytes, args.reps)
                inline = inline_seconds(stub, consumer, nbytes, args.reps)
                print(
                    f"{size_mib:>5} MiB | {copy * 1e3:7.2f} ms {nbytes / copy / 1e9:4.1f}G | "
                    f"{nixl * 1e3:7.2f} ms {nbytes / nixl / 1e9:5.1f} GB/s | "
                    f"{copy / nixl:6.2f}x ({copy / nixl_best:4.2f}x) | "
                    f"{inline * 1e3:7.2f} ms {nbytes / inline / 1e9:5.1f} GB/s | {nixl / inline:15.2f}x"
                )
            median, p99 = latency_64k(peer, consumer, args.latency_count)
            print(
                f"64 KiB fetch latency: median {median * 1e6:.0f} us, p99 {p99 * 1e6:.0f} us "
                f"({args.latency_count} runs)"
            )

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
