"""A producer in another process, driven over a pipe, for the transfer tests and the benchmark.

`PeerProcess.start(config)` spawns a fresh interpreter that creates a `TransferAgent` and a
`TensorProducer` and answers commands (`put`, `put_inline`, `pressure`, `stats`, `release`). Every
tensor it publishes is random (seeded), never zeros; `put` returns the handle and a SHA-256 per
tensor so the test can check the consumer's bytes. `stop()` ends it by PID (kill if it does not
exit), so no test leaves a process behind. `Resolver` answers a consumer's metadata lookups.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import multiprocessing
import os
import signal
import time
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch

from libs.contract.epd.v1 import tensor_pb2

# (name, shape, dtype name) of a tensor to publish.
TensorRequest = tuple[str, Sequence[int], str]


def random_tensor(shape: Sequence[int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random, never all-zero data of any supported dtype."""
    gen = torch.Generator().manual_seed(seed)
    shape = tuple(shape)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype) * 3 + 1
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen, dtype=torch.uint8).bool()
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=dtype)


def digest(tensor: torch.Tensor) -> str:
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(raw.numpy()).hexdigest()


class PeerError(Exception):
    """An error raised in the peer; `type_name` and `grpc_code` name the original."""

    def __init__(self, type_name: str, message: str, grpc_code: str) -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.grpc_code = grpc_code


@dataclasses.dataclass
class Published:
    handle: tensor_pb2.TensorHandle
    digests: dict[str, str]


class PeerProcess:
    def __init__(self, process: multiprocessing.process.BaseProcess, conn: Connection, info: bytes) -> None:
        self.process = process
        self.conn = conn
        self.metadata_info = info
        from libs.contract.epd.v1 import service_info_pb2

        self.agent_info = service_info_pb2.NixlAgentInfo.FromString(info)

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    @property
    def metadata(self) -> bytes:
        return self.agent_info.metadata

    @classmethod
    def start(cls, *, netns: str | None = None, **config: Any) -> PeerProcess:
        """A producer with `TransferConfig(**config)`, in network namespace `netns` if given."""
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        process = ctx.Process(target=_serve, args=(child, config, netns), daemon=True)
        process.start()
        child.close()
        if not parent.poll(60):
            process.kill()
            raise RuntimeError("peer process did not start")
        status, payload = parent.recv()
        if status != "ready":
            process.kill()
            raise RuntimeError(f"peer process failed to start: {payload}")
        return cls(process, parent, payload)

    def call(self, command: str, *args: Any, timeout: float = 60) -> Any:
        self.conn.send((command, args))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"peer did not answer {command} within {timeout} s")
        reply = self.conn.recv()
        if reply[0] == "err":
            raise PeerError(*reply[1:])
        return reply[1]

    def put(self, tensors: Sequence[TensorRequest], *, seed: int, ttl_s: float | None = None) -> Published:
        raw, digests = self.call("put", list(tensors), seed, ttl_s)
        return Published(tensor_pb2.TensorHandle.FromString(raw), digests)

    def put_inline(self, tensors: Sequence[TensorRequest], *, seed: int) -> Published:
        raw, digests = self.call("put_inline", list(tensors), seed)
        return Published(tensor_pb2.TensorHandle.FromString(raw), digests)

    def stats(self) -> dict[str, Any]:
        result: dict[str, Any] = self.call("stats")
        return result

    def wait_leases_settled(self, timeout: float = 30.0) -> dict[str, Any]:
        """Poll until no lease is active (acks are asynchronous; a loaded host delays them), bounded;
        returns the last stats."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if stats["leases"]["active"] == 0 or time.monotonic() > deadline:
                return stats
            time.sleep(0.01)

    def cpu_seconds(self) -> float:
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        return (int(fields[11]) + int(fields[12])) / ticks  # utime + stime

    def freeze(self) -> None:
        """SIGSTOP, and wait until every thread has actually stopped (delivery is asynchronous; on a
        busy host a thread may otherwise still serve a request after kill() returned)."""
        os.kill(self.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while not all(_task_state(self.pid, task) in ("T", "t") for task in os.listdir(f"/proc/{self.pid}/task")):
            if time.monotonic() > deadline:
                raise TimeoutError(f"peer {self.pid} did not stop")
            time.sleep(0.001)

    def thaw(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.process.is_alive():
            os.kill(self.pid, signal.SIGKILL)
        self.process.join(10)

    def stop(self) -> None:
        if self.process.is_alive():
            self.thaw()
            with contextlib.suppress(OSError):
                self.conn.send(("close", ()))
            self.process.join(5)
        self.kill()
        self.conn.close()


MiB = 1 << 20


class Resolver:
    """Metadata by agent name, as a service's GetServiceInfo call would return it; counts calls."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}
        self.calls = 0

    def add(self, peer: PeerProcess) -> None:
        self.blobs[peer.agent_info.agent_name] = peer.metadata

    def __call__(self, ref: tensor_pb2.NixlAgentRef) -> bytes:
        self.calls += 1
        return self.blobs[ref.agent_name]


def _task_state(pid: int, task: str) -> str:
    try:
        with open(f"/proc/{pid}/task/{task}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "T"  # thread exited


# --- the child ----------------------------------------------------------------------------------


def _serve(conn: Connection, config: dict[str, Any], netns: str | None = None) -> None:
    from libs.transfer import PoolExhausted, TensorProducer, TransferAgent, TransferConfig, TransferError

    try:
        if netns is not None:  # before the agent exists: UCX binds its sockets in that namespace
            from tests.support.netns import enter

            enter(netns)
        agent = TransferAgent(TransferConfig(**config))
        producer = TensorProducer(agent, producer_address="127.0.0.1:50051")
    except Exception:
        conn.send(("failed", traceback.format_exc()))
        return
    conn.send(("ready", agent.agent_info().SerializeToString()))

    def make(requests: Sequence[TensorRequest], seed: int) -> dict[str, torch.Tensor]:
        return {
            name: random_tensor(shape, getattr(torch, dtype), seed + i)
            for i, (name, shape, dtype) in enumerate(requests)
        }

    def pressure(block_bytes: int, rounds: int) -> int:
        """Allocate until the pool is full, scribble over every block, free; `rounds` times.
        Returns how many times the pool said it was exhausted."""
        exhausted = 0
        for _ in range(rounds):
            held = []
            while True:
                try:
                    held.append(producer.reserve({"scratch": ((block_bytes,), torch.uint8)}))
                except PoolExhausted:
                    exhausted += 1
                    break
            for reservation in held:
                reservation.tensors["scratch"].fill_(0x5A)
                reservation.abort()
        return exhausted

    def stats() -> dict[str, Any]:
        leases = dataclasses.asdict(producer.lease_stats())  # first: a lease seen gone has its slot freed
        return {"pool": dataclasses.asdict(agent.pool.stats()), "leases": leases}

    def put(requests: Sequence[TensorRequest], seed: int, ttl_s: float | None) -> tuple[bytes, dict[str, str]]:
        tensors = make(requests, seed)
        return _published(producer.put(tensors, ttl_s=ttl_s), tensors)

    def put_inline(requests: Sequence[TensorRequest], seed: int) -> tuple[bytes, dict[str, str]]:
        tensors = make(requests, seed)
        return _published(producer.put_inline(tensors), tensors)

    commands = {
        "put": put,
        "put_inline": put_inline,
        "pressure": pressure,
        "stats": stats,
        "release": lambda ids: producer.release(ids),
    }
    while True:
        try:
            command, args = conn.recv()
        except EOFError:
            break
        if command == "close":
            break
        try:
            conn.send(("ok", commands[command](*args)))
        except TransferError as exc:
            conn.send(("err", type(exc).__name__, str(exc), exc.grpc_code.name))
        except Exception as exc:
            conn.send(("err", type(exc).__name__, traceback.format_exc(), "UNKNOWN"))
    agent.close()


def _published(handle: tensor_pb2.TensorHandle, tensors: dict[str, torch.Tensor]) -> tuple[bytes, dict[str, str]]:
    return handle.SerializeToString(), {name: digest(t) for name, t in tensors.items()}
