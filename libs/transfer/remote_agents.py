"""Consumer-side cache of producers' agent metadata, fetched once per peer incarnation.

`TensorConsumer` calls `RemoteAgents.ensure(ref)` before every READ. The first handle from an agent
calls the pluggable `AgentMetadataLookup` (services plug a `GetServiceInfo` call to
`ref.producer_address` that returns `NixlAgentInfo.metadata`; tests pass the blob directly) and
loads the blob into the local NIXL agent. Later handles from the same incarnation cost a dict
lookup. When a handle names another `instance_id` for a known agent name, the peer restarted: the
old incarnation is forgotten (and remembered as retired, so its leftover handles fail fast as
stale) and the metadata is fetched again. A peer that dies is forgotten by the consumer, so the
next handle re-resolves it.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable

from libs.contract.epd.v1 import tensor_pb2
from libs.transfer.agent import TransferAgent
from libs.transfer.errors import PeerUnavailable, StaleHandle, TransferError


@dataclasses.dataclass(frozen=True)
class AgentMetadata:
    """What a resolver knows of a producer's agent."""

    blob: bytes  # NIXL agent metadata, taken after its memory registration
    lease_stamps: bool = False  # the producer stamps its slots (libs/transfer/stamp.py): check them
    checksums: bool = False  # the producer attaches a CRC to every tensor: require them


# Returns the agent metadata of the agent `ref` names; a bare blob means a producer without stamps.
AgentMetadataLookup = Callable[[tensor_pb2.NixlAgentRef], "bytes | AgentMetadata"]

# Retired incarnations remembered per agent name (enough for restart loops; bounded memory).
_RETIRED_KEPT = 16


@dataclasses.dataclass
class _Peer:
    instance_id: str
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    loaded: bool = False
    retired: collections.deque[str] = dataclasses.field(default_factory=lambda: collections.deque(maxlen=_RETIRED_KEPT))


class RemoteAgents:
    """Thread-safe map agent name -> loaded incarnation. `resolve_calls` counts resolver calls."""

    def __init__(self, agent: TransferAgent, resolve: AgentMetadataLookup) -> None:
        self._agent = agent
        self._resolve = resolve
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        # agent name -> instance id of the incarnation loaded now: the lock-free path of `ensure`
        # (entries change only under the peer's lock).
        self._loaded: dict[str, str] = {}
        self._stamped: dict[str, bool] = {}  # agent name -> its producer stamps slots
        self._checksums: dict[str, bool] = {}  # agent name -> its producer checksums every tensor
        self.resolve_calls = 0

    def ensure(self, ref: tensor_pb2.NixlAgentRef) -> str:
        """Make `ref`'s agent readable; returns its NIXL name. Raises `StaleHandle` for a retired
        incarnation, `PeerUnavailable` when its metadata cannot be obtained or loaded."""
        name = ref.agent_name
        instance_id = ref.instance_id
        if self._loaded.get(name) == instance_id:
            return name
        with self._lock:
            peer = self._peers.setdefault(name, _Peer(instance_id=instance_id))
        with peer.lock:
            if ref.instance_id in peer.retired:
                raise StaleHandle(f"agent {name} incarnation {ref.instance_id} was replaced (peer restarted)")
            if peer.loaded and peer.instance_id == ref.instance_id:
                return name
            if peer.loaded:
                self._loaded.pop(name, None)
                self._agent.forget_peer(name)
                peer.retired.append(peer.instance_id)
                peer.loaded = False
            peer.instance_id = ref.instance_id
            metadata = self._fetch(ref)
            loaded_name = self._agent.load_peer(metadata.blob)
            if loaded_name != name:
                raise StaleHandle(
                    f"producer {ref.producer_address} now runs agent {loaded_name}, not {name} "
                    "(it restarted); the handle is stale"
                )
            peer.loaded = True
            self._stamped[name] = metadata.lease_stamps
            self._checksums[name] = metadata.checksums
            self._loaded[name] = peer.instance_id
            return name

    def stamped(self, name: str) -> bool:
        """Whether the loaded agent's producer stamps its slots (so every READ checks the stamp)."""
        return self._stamped.get(name, False)

    def checksums(self, name: str) -> bool:
        """Whether the loaded agent's producer checksums every tensor (so handles must carry them)."""
        return self._checksums.get(name, False)

    def forget(self, name: str) -> None:
        """Drop a peer after a failure (dead or disconnected); the next handle re-resolves it."""
        with self._lock:
            peer = self._peers.get(name)
        if peer is None:
            return
        with peer.lock:
            if peer.loaded:
                self._loaded.pop(name, None)
                self._agent.forget_peer(name)
                peer.loaded = False

    def _fetch(self, ref: tensor_pb2.NixlAgentRef) -> AgentMetadata:
        with self._lock:
            self.resolve_calls += 1
        try:
            metadata = self._resolve(ref)
        except TransferError:
            raise
        except Exception as exc:
            raise PeerUnavailable(
                f"cannot obtain metadata of agent {ref.agent_name} from {ref.producer_address or '?'}: {exc}"
            ) from exc
        if isinstance(metadata, bytes):
            metadata = AgentMetadata(metadata)
        if not metadata.blob:
            raise PeerUnavailable(f"no metadata for agent {ref.agent_name} from {ref.producer_address or '?'}")
        return metadata
