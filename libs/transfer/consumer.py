"""Consumer side: turn received `TensorHandle`s into torch tensors in this process's pool.

Called in the consuming process: prefill (embeddings from encoders) and decode (KV from prefill),
usually from a worker thread (`fetch` blocks; NIXL's `transfer` releases the GIL).

For each NIXL handle, `fetch` / `fetch_many`:
1. validates it (contract rules, host memory, expected specs, lease not expired) - `BadDescriptor`,
   `SpecMismatch`, `StaleHandle`, all before touching the network;
2. makes the producer's agent known (`RemoteAgents`: metadata fetched once per incarnation);
3. allocates one local slot, builds the tensor views over it, and posts one READ of all the
   handle's tensors into it (`fetch_many` posts every handle's READ before waiting on any). The
   views come first because the copy sweeps the CPU caches: work done after it runs cold;
4. waits with a deadline of ours (NIXL has none; also capped by the lease's expiry). On timeout
   the READ is cancelled and the slot quarantined (a late write may still land) -
   `TransferTimeout`; a dead peer is `PeerUnavailable`; a region outside the producer's registered
   memory is `DescriptorOutOfBounds`;
5. checks the lease stamp read with the tensors when the producer stamps its slots (a made-up,
   released, expired or reused lease is `StaleHandle`; libs/transfer/stamp.py), verifies checksums
   when present, queues the notification to the producer (message: the lease id) for the agent's
   service thread, which sends it at once, off the caller's path, and returns `ReceivedTensors`
   whose tensors view the slot without a copy.

The caller releases each `ReceivedTensors` (context manager or `release()`) once it no longer
needs the tensors; until then the slot stays out of the pool. INLINE handles go through the same
calls; their bytes are copied once out of the message.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence

import torch

from libs.contract.epd.v1 import tensor_pb2
from libs.transfer.agent import PendingRead, Range, ReadState, TransferAgent
from libs.transfer.errors import (
    BadDescriptor,
    DescriptorOutOfBounds,
    InlineRefused,
    InlineTooLarge,
    PeerUnavailable,
    StaleHandle,
    TransferError,
    TransferTimeout,
)
from libs.transfer.handles import (
    ExpectedTensor,
    check_expected,
    packed_offsets,
    seconds_left,
    validate_handle,
    verify_checksum,
    view_tensor,
)
from libs.transfer.pool import MemoryPool, Slot
from libs.transfer.remote_agents import AgentMetadataLookup, RemoteAgents
from libs.transfer.stamp import STAMP_BYTES
from libs.transfer.stamp import verify as verify_stamp

Expectation = Mapping[str, ExpectedTensor]

# Waiting for a READ. UCX moves the bytes (cross-memory attach, one 512 KiB segment per progress
# call) only while some thread progresses its worker: our polls (each runs progress until it stalls)
# or NIXL's progress thread. So the waiting thread polls without sleeping for as long as the READ
# can be expected to take - a fixed allowance plus its bytes at a pessimistic copy rate, capped - and
# only then backs off to sleeps (growing to a bound), so a stalled or frozen peer does not cost a
# core. Most READs complete inside `transfer()` already; the spin covers the rest.
_SPIN_BASE_S = 0.001
_SPIN_BYTES_PER_S = 1e9  # a low allowance for the copy rate, not an estimate
_SPIN_MAX_S = 0.25
_FIRST_SLEEP_S = 0.0001
_MAX_SLEEP_S = 0.001


def spin_allowance_s(nbytes: int) -> float:
    """How long `fetch` polls a READ of `nbytes` without sleeping (see above)."""
    return min(_SPIN_MAX_S, _SPIN_BASE_S + nbytes / _SPIN_BYTES_PER_S)


class ReceivedTensors:
    """Tensors of one handle, viewing this process's memory. Release when done with them."""

    def __init__(
        self,
        lease_id: str,
        tensors: dict[str, torch.Tensor],
        *,
        pool: MemoryPool | None = None,
        slot: Slot | None = None,
        poison: bool = False,
    ) -> None:
        self.lease_id = lease_id
        self.tensors = tensors
        self._pool = pool
        self._slot = slot
        self._poison = poison

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def release(self) -> None:
        """Give the slot back to the pool; the tensors must not be used afterwards. Idempotent."""
        if self._pool is not None and self._slot is not None:
            pool, slot = self._pool, self._slot
            self._pool = self._slot = None
            pool.free(slot, poison=self._poison)

    def __enter__(self) -> ReceivedTensors:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


@dataclasses.dataclass
class _Job:
    """One NIXL handle on its way in."""

    handle: tensor_pb2.TensorHandle
    lease_id: str
    offsets: list[int]
    total: int  # bytes of the local slot (tensors packed, aligned)
    deadline: float
    peer: str = ""
    slot: Slot | None = None
    read: PendingRead | None = None
    outcome: str = ""  # DONE, ERR or TIMEOUT once settled
    stamped: bool = False  # the slot's first STAMP_BYTES hold the producer's lease stamp
    # Built before the READ is posted (see `_post`): the views returned, and the checksums to verify
    # as (name, checksum, offset in the slot, bytes).
    tensors: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    checks: list[tuple[str, tensor_pb2.Checksum, int, int]] = dataclasses.field(default_factory=list)


class TensorConsumer:
    """Fetches tensors from producers' pools into this process's pool. One per process (agent)."""

    def __init__(self, agent: TransferAgent, resolve_metadata: AgentMetadataLookup) -> None:
        self.agent = agent
        self.peers = RemoteAgents(agent, resolve_metadata)

    def fetch(
        self,
        handle: tensor_pb2.TensorHandle,
        *,
        expected: Expectation | None = None,
        timeout_s: float | None = None,
    ) -> ReceivedTensors:
        return self.fetch_many([handle], expected=[expected], timeout_s=timeout_s)[0]

    def fetch_many(
        self,
        handles: Sequence[tensor_pb2.TensorHandle],
        *,
        expected: Sequence[Expectation | None] | None = None,
        timeout_s: float | None = None,
    ) -> list[ReceivedTensors]:
        """Fetch every handle, READs in flight together; all or nothing (on error, every slot
        taken here is released or quarantined and the first error is raised)."""
        if expected is not None and len(expected) != len(handles):
            raise ValueError("expected must have one entry per handle")
        timeout = self.agent.config.transfer_timeout_s if timeout_s is None else timeout_s
        start = time.monotonic()
        for i, handle in enumerate(handles):
            validate_handle(handle)
            if expected is not None and expected[i] is not None:
                check_expected(handle, expected[i])  # type: ignore[arg-type]
        results: list[ReceivedTensors | None] = [None] * len(handles)
        jobs: dict[int, _Job] = {}
        try:
            for i, handle in enumerate(handles):
                if handle.transport == tensor_pb2.TRANSPORT_KIND_INLINE:
                    results[i] = self._take_inline(handle)
                else:
                    jobs[i] = self._prepare(handle, start + timeout)
                    self._post(jobs[i])
            self._wait(list(jobs.values()))
            errors: list[TransferError] = []
            for i, job in jobs.items():
                try:  # finish (and ack) every READ that completed, even when another failed
                    results[i] = self._finish(job)
                except TransferError as exc:
                    errors.append(exc)
            if errors:
                raise errors[0]
        except BaseException:
            for job in jobs.values():
                self._abandon(job)
            for result in results:
                if result is not None:
                    result.release()
            raise
        return [r for r in results if r is not None]

    # --- steps ---------------------------------------------------------------------------------

    def _prepare(self, handle: tensor_pb2.TensorHandle, deadline: float) -> _Job:
        left = seconds_left(handle.lease_expire_time)
        if left < self.agent.config.min_lease_remaining_s:
            raise StaleHandle(f"lease {handle.lease_id} expired {max(-left, 0.0):.3f} s ago (or is about to)")
        offsets, total = packed_offsets([desc.spec.nbytes for desc in handle.tensors])
        # Never read past the lease: after expiry the producer may reuse the memory.
        return _Job(
            handle=handle,
            lease_id=handle.lease_id,
            offsets=offsets,
            total=total,
            deadline=min(deadline, time.monotonic() + left),
        )

    def _post(self, job: _Job) -> None:
        handle = job.handle
        job.peer = self.peers.ensure(handle.agent)
        job.stamped = self.peers.stamped(job.peer)
        if self.peers.checksums(job.peer):
            missing = [desc.name for desc in handle.tensors if desc.spec.nbytes and not desc.HasField("checksum")]
            if missing:
                raise BadDescriptor(
                    f"handle {handle.lease_id}: tensors {missing} lack the checksum agent {job.peer} attaches to "
                    "every tensor",
                    field="handle.tensors.checksum",
                )
        base = STAMP_BYTES if job.stamped else 0  # local layout mirrors the producer's
        slot = job.slot = self.agent.pool.allocate(base + job.total)
        buffer = self.agent.pool.buffer
        verify = self.agent.config.verify_checksum
        local: list[Range] = []
        remote: list[Range] = []
        # Everything returned to the caller is built now, before the READ: the copy sweeps the
        # caches, so work done after it runs on cold caches.
        for desc, offset in zip(handle.tensors, job.offsets, strict=True):
            spec = desc.spec
            job.tensors[desc.name] = view_tensor(buffer, slot.offset + base + offset, spec)
            if verify and desc.HasField("checksum"):
                job.checks.append((desc.name, desc.checksum, base + offset, spec.nbytes))
            address = slot.address + base + offset
            for region in desc.regions:
                local.append((address, region.length))
                remote.append((region.address, region.length))
                address += region.length
        if not remote:  # only empty tensors: nothing to move
            job.outcome = ReadState.DONE
            job.stamped = False
            return
        if job.stamped:
            # The stamp sits just before where the producer packed the first tensor with bytes.
            first = next(i for i, desc in enumerate(handle.tensors) if desc.regions)
            stamp_address = handle.tensors[first].regions[0].address - job.offsets[first] - STAMP_BYTES
            if stamp_address < 0:
                raise DescriptorOutOfBounds(
                    f"handle {handle.lease_id}: regions do not follow a lease stamp", field="handle.tensors.regions"
                )
            local.append((slot.address, STAMP_BYTES))
            remote.append((stamp_address, STAMP_BYTES))
        try:
            job.read = self.agent.start_read(job.peer, local, remote)
            if job.read.state == ReadState.DONE:  # `transfer()` usually moves all the bytes itself
                job.outcome = ReadState.DONE
        except LookupError as exc:
            if not self.agent.knows_peer(job.peer):
                self.peers.forget(job.peer)
                raise PeerUnavailable(f"agent {job.peer} is unknown to NIXL: {exc}") from exc
            raise DescriptorOutOfBounds(
                f"handle {handle.lease_id}: a region is outside the registered memory of agent {job.peer}",
                field="handle.tensors.regions",
            ) from exc
        except PeerUnavailable:
            self.peers.forget(job.peer)
            raise

    def _wait(self, jobs: list[_Job]) -> None:
        pending = [job for job in jobs if not job.outcome]
        if not pending:
            return
        spin_until = time.monotonic() + spin_allowance_s(sum(job.total for job in pending))
        sleep_s = _FIRST_SLEEP_S
        while True:
            still = []
            now = time.monotonic()
            for job in pending:
                assert job.read is not None
                state = self.agent.poll(job.read)
                if state != ReadState.IN_PROGRESS:
                    job.outcome = state
                elif now >= job.deadline:
                    job.outcome = "TIMEOUT"
                else:
                    still.append(job)
            pending = still
            if not pending:
                return
            if now < spin_until:
                time.sleep(0)  # let other Python threads run; the READ progresses in our next poll
            else:
                time.sleep(sleep_s)
                sleep_s = min(_MAX_SLEEP_S, sleep_s * 2)

    def _finish(self, job: _Job) -> ReceivedTensors:
        assert job.slot is not None
        if job.read is not None:
            self.agent.cancel(job.read)
        handle = job.handle
        if job.outcome == "TIMEOUT":
            raise TransferTimeout(
                f"READ of lease {handle.lease_id} from agent {job.peer} did not complete before its deadline; "
                "cancelled, local slot quarantined"
            )
        if job.outcome != ReadState.DONE:
            self.peers.forget(job.peer)
            raise PeerUnavailable(f"READ of lease {handle.lease_id} from agent {job.peer} failed (peer gone?)")
        pool = self.agent.pool
        data = pool.view(job.slot)
        if job.stamped:
            # Not this lease's memory: acking would free whatever lease really holds it.
            verify_stamp(data, job.lease_id, job.peer)
        try:
            for name, checksum, offset, nbytes in job.checks:
                verify_checksum(name, checksum, data[offset : offset + nbytes])
        finally:
            # We will not read this lease again, whatever the verification said: let it go. The
            # service thread sends it, off the caller's path.
            self.agent.notify_soon(job.peer, job.lease_id.encode())
        received = ReceivedTensors(
            job.lease_id, job.tensors, pool=pool, slot=job.slot, poison=self.agent.config.poison_freed
        )
        job.slot = None  # owned by `received` now
        return received

    def _abandon(self, job: _Job) -> None:
        """Undo a job that will not be returned: free its slot, or quarantine it if a READ may
        still be writing into it."""
        if job.slot is None:
            return
        job.tensors.clear()  # views of a slot that is not returned
        slot, job.slot = job.slot, None
        if job.read is not None and not job.outcome and not self.agent.closed:
            job.outcome = self.agent.poll(job.read)  # most READs are done by now: no quarantine then
        if job.read is None or job.outcome in (ReadState.DONE, ReadState.ERROR):
            if job.read is not None:
                self.agent.cancel(job.read)
            self.agent.pool.free(slot, poison=self.agent.config.poison_freed)
            return
        released = self.agent.cancel(job.read)  # running or timed out: cancel, then quarantine
        self.agent.quarantine(slot, None if released else job.read)

    def _take_inline(self, handle: tensor_pb2.TensorHandle) -> ReceivedTensors:
        if not self.agent.config.accept_inline:
            raise InlineRefused(
                f"inline handle {handle.lease_id}: tensor bytes inside a request are accepted only from "
                "authenticated callers (TLS) or with accept_inline"
            )
        payload = sum(desc.spec.nbytes for desc in handle.tensors)
        limit = self.agent.config.inline_max_bytes
        if payload > limit:
            raise InlineTooLarge(f"inline handle {handle.lease_id} carries {payload} bytes; the bound is {limit}")
        offsets, total = packed_offsets([desc.spec.nbytes for desc in handle.tensors])
        data = bytearray(total)  # the one copy: protobuf bytes are immutable
        tensors = {}
        for desc, offset in zip(handle.tensors, offsets, strict=True):
            data[offset : offset + desc.spec.nbytes] = desc.inline_data
            if self.agent.config.verify_checksum and desc.HasField("checksum"):
                verify_checksum(desc.name, desc.checksum, desc.inline_data)
            tensors[desc.name] = view_tensor(data, offset, desc.spec)
        return ReceivedTensors(handle.lease_id, tensors)
