"""Out-of-band tensor transport between EPD processes (NIXL READs between CPU mmap pools).

One `TransferAgent` per process owns the NIXL agent and the registered pool; a producer process
publishes tensors with `TensorProducer`, a consumer process fetches them with `TensorConsumer`.
Handles are epd.v1 `TensorHandle`s. Every failure is a typed `TransferError` carrying its gRPC code.
See docs/transfer.md.
"""

from libs.transfer.agent import TransferAgent
from libs.transfer.config import TransferConfig
from libs.transfer.consumer import ReceivedTensors, TensorConsumer
from libs.transfer.errors import (
    AgentClosed,
    BadDescriptor,
    ChecksumMismatch,
    DescriptorOutOfBounds,
    InlineTooLarge,
    PeerUnavailable,
    PoolExhausted,
    SpecMismatch,
    StaleHandle,
    TransferError,
    TransferFailed,
    TransferTimeout,
)
from libs.transfer.handles import ExpectedTensor
from libs.transfer.leases import LeaseStats
from libs.transfer.pool import PoolStats
from libs.transfer.producer import Reservation, TensorProducer
from libs.transfer.remote_agents import AgentMetadata, AgentMetadataLookup

__all__ = [
    "AgentClosed",
    "AgentMetadata",
    "AgentMetadataLookup",
    "BadDescriptor",
    "ChecksumMismatch",
    "DescriptorOutOfBounds",
    "ExpectedTensor",
    "InlineTooLarge",
    "LeaseStats",
    "PeerUnavailable",
    "PoolExhausted",
    "PoolStats",
    "ReceivedTensors",
    "Reservation",
    "SpecMismatch",
    "StaleHandle",
    "TensorConsumer",
    "TensorProducer",
    "TransferAgent",
    "TransferConfig",
    "TransferError",
    "TransferFailed",
    "TransferTimeout",
]
