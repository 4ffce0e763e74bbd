"""Producer side: place tensors in pool slots and hand out `TensorHandle`s, holding each slot for
its consumer until the completion notification, an explicit release, or lease expiry.

Called in the producing process: the encoder (embeddings of one item per handle) and prefill (all
per-layer KV tensors `layers.<i>.key` / `layers.<i>.value` of one request per handle).

- `put(tensors)`: copy tensors into one slot, return a NIXL handle. `reserve(specs)` + fill +
  `publish()` lets a model write straight into the slot instead. Each slot starts with a lease
  stamp (libs/transfer/stamp.py) that consumers check; the tensors follow it.
- `put_inline(tensors)`: the same handle shape with the bytes inside it (TRANSPORT_KIND_INLINE),
  bounded by `inline_max_bytes`; nothing is held.
- `release(lease_ids)`: what `LeaseService.ReleaseLeases` calls.
- The agent's service thread delivers completion notifications (message = lease id) and runs the
  expiry reaper; both return slots to the pool (poisoned first when `poison_freed`).

A full pool is `PoolExhausted` (RESOURCE_EXHAUSTED), never an overwrite of a held slot.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Mapping, Sequence

import torch

from libs.contract.epd.v1 import tensor_pb2
from libs.transfer.agent import TransferAgent
from libs.transfer.errors import InlineTooLarge, SpecMismatch
from libs.transfer.handles import crc32, expiry_timestamp, make_spec, packed_offsets, view_tensor
from libs.transfer.leases import Completion, Lease, LeaseStats, LeaseTable
from libs.transfer.pool import Slot
from libs.transfer.stamp import STAMP_BYTES
from libs.transfer.stamp import write as write_stamp

# name -> (shape, dtype) of a tensor to reserve.
TensorSpecs = Mapping[str, tuple[Sequence[int], torch.dtype]]


class Reservation:
    """Tensors allocated in one slot, to be filled in place and then published as one handle.
    Use as a context manager: leaving it by an exception returns the slot to the pool."""

    def __init__(
        self, producer: TensorProducer, slot: Slot, specs: dict[str, tensor_pb2.TensorSpec], offsets: list[int]
    ) -> None:
        self._producer = producer
        self._slot = slot
        self._specs = specs
        self._offsets = offsets
        self._done = False
        buffer = producer.agent.pool.buffer
        self.tensors: dict[str, torch.Tensor] = {
            name: view_tensor(buffer, slot.offset + offset, spec)
            for (name, spec), offset in zip(specs.items(), offsets, strict=True)
        }

    @property
    def slot(self) -> Slot:
        return self._slot

    def placement(self) -> list[tuple[str, int]]:
        """(name, byte offset in the pool) of each tensor, in order: where another writer of a
        shared pool puts them (libs/backends/vllm/ec_producer.py)."""
        return [(name, self._slot.offset + offset) for name, offset in zip(self._specs, self._offsets, strict=True)]

    def publish(self, *, ttl_s: float | None = None) -> tensor_pb2.TensorHandle:
        """Start the lease and return the handle. The tensors must not be written afterwards."""
        if self._done:
            raise RuntimeError("reservation already published or aborted")
        handle = self._producer._publish(self._slot, self._specs, self._offsets, ttl_s)
        self._done = True
        return handle

    def detach(self) -> None:
        """Give up the reservation without freeing its slot (the caller quarantines it);
        RuntimeError when it was already published or aborted."""
        if self._done:
            raise RuntimeError("reservation already published or aborted")
        self._done = True

    def abort(self) -> None:
        if not self._done:
            self._done = True
            self._producer.agent.pool.free(self._slot, poison=self._producer.agent.config.poison_freed)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if exc_type is not None:
            self.abort()


class TensorProducer:
    """Publishes tensors from this process's pool. One per process (per agent)."""

    def __init__(self, agent: TransferAgent, *, producer_address: str) -> None:
        self.agent = agent
        self.producer_address = producer_address
        self._leases = LeaseTable(agent.pool, poison_freed=agent.config.poison_freed)
        agent.on_notification(self._on_notification)
        agent.add_periodic(self._leases.reap)

    def reserve(self, specs: TensorSpecs) -> Reservation:
        """Allocate one slot holding every tensor of `specs` (in order); `PoolExhausted` if full."""
        if not specs:
            raise SpecMismatch("a handle needs at least one tensor")
        protos = {name: make_spec(shape, dtype) for name, (shape, dtype) in specs.items()}
        offsets, total = packed_offsets([spec.nbytes for spec in protos.values()])
        slot = self.agent.pool.allocate(STAMP_BYTES + total)
        return Reservation(self, slot, protos, [STAMP_BYTES + offset for offset in offsets])

    def put(self, tensors: Mapping[str, torch.Tensor], *, ttl_s: float | None = None) -> tensor_pb2.TensorHandle:
        """Copy `tensors` into one slot and return their NIXL handle (one lease)."""
        with self.reserve({name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}) as reservation:
            for name, tensor in tensors.items():
                reservation.tensors[name].copy_(tensor)
            return reservation.publish(ttl_s=ttl_s)

    def put_inline(self, tensors: Mapping[str, torch.Tensor]) -> tensor_pb2.TensorHandle:
        """The tensors' bytes inside the handle (TRANSPORT_KIND_INLINE); nothing is held."""
        if not tensors:
            raise SpecMismatch("a handle needs at least one tensor")
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        limit = self.agent.config.inline_max_bytes
        if total > limit:
            raise InlineTooLarge(f"{total} bytes of tensors exceed the inline transport's bound of {limit} bytes")
        handle = tensor_pb2.TensorHandle(
            transport=tensor_pb2.TRANSPORT_KIND_INLINE,
            lease_id=self._new_lease_id(),
            lease_expire_time=expiry_timestamp(self.agent.config.lease_ttl_s),
        )
        for name, tensor in tensors.items():
            data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            desc = handle.tensors.add(name=name, spec=make_spec(tuple(tensor.shape), tensor.dtype), inline_data=data)
            if self.agent.config.checksum:
                desc.checksum.CopyFrom(crc32(data))
        return handle

    def release(self, lease_ids: Iterable[str]) -> int:
        """Free leases without a READ (`LeaseService.ReleaseLeases`); returns how many were held."""
        return sum(self._leases.complete(lease_id, Completion.RELEASED) for lease_id in lease_ids)

    def lease_stats(self) -> LeaseStats:
        return self._leases.stats()

    def _publish(
        self, slot: Slot, specs: dict[str, tensor_pb2.TensorSpec], offsets: list[int], ttl_s: float | None
    ) -> tensor_pb2.TensorHandle:
        ttl = self.agent.config.lease_ttl_s if ttl_s is None else ttl_s
        handle = tensor_pb2.TensorHandle(
            transport=tensor_pb2.TRANSPORT_KIND_NIXL,
            agent=self.agent.agent_ref(self.producer_address),
            lease_id=self._new_lease_id(),
            lease_expire_time=expiry_timestamp(ttl),
        )
        buffer = self.agent.pool.buffer
        write_stamp(memoryview(buffer)[slot.offset : slot.offset + STAMP_BYTES], handle.lease_id)
        for (name, spec), offset in zip(specs.items(), offsets, strict=True):
            desc = handle.tensors.add(name=name, spec=spec)
            if spec.nbytes:
                desc.regions.add(
                    address=slot.address + offset,
                    length=spec.nbytes,
                    device_id=0,
                    memory_kind=tensor_pb2.MEMORY_KIND_CPU,
                )
            if self.agent.config.checksum:
                start = slot.offset + offset
                desc.checksum.CopyFrom(crc32(memoryview(buffer)[start : start + spec.nbytes]))
        self._leases.add(Lease(handle.lease_id, slot, time.monotonic() + ttl))
        self.agent.wake()  # an ack may come soon: poll notifications fast from now on
        return handle

    def _on_notification(self, sender: str, message: bytes) -> None:
        self._leases.complete(message.decode("utf-8", "replace"), Completion.ACKED)

    def _new_lease_id(self) -> str:
        return f"{self.agent.instance_id[:8]}-{uuid.uuid4().hex}"
