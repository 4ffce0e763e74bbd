"""The process's NIXL agent: one per process, owning the registered pool and a service thread.

Created once at start-up by every process that produces or consumes tensors (encoder, prefill,
decode); `TensorProducer` and `TensorConsumer` are built on it. It:

- creates a NIXL agent with the UCX backend, confined to loopback by `TransferConfig` (env applied
  just before the UCX context is created). NIXL's progress thread runs event-driven: it sleeps in
  poll() on the UCX workers' event fds (the Python API would make it spin a core); it must run so a
  peer's READ issued after a notification completes without waiting for our next poll;
- maps the `MemoryPool` and registers it with NIXL exactly once, then takes the agent metadata
  (the blob peers load; it must be taken after registration);
- runs one service thread that sends the consumer's queued acknowledgments (`notify_soon`: woken
  at once), collects NIXL notifications (`busy_poll_s` while something is outstanding, `idle_poll_s`
  otherwise, so an idle agent sleeps instead of spinning), dispatches them to the producer, runs periodic
  tasks (lease reaper) and releases quarantined slots;
- wraps every NIXL call a transfer needs and turns NIXL exceptions into typed `TransferError`s.

All methods are thread-safe (NIXL runs in STRICT thread-sync mode). NIXL has no timeouts: callers
wait with deadlines of their own (see `TensorConsumer`).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from libs.contract.epd.v1 import service_info_pb2, tensor_pb2
from libs.transfer.config import TransferConfig
from libs.transfer.errors import AgentClosed, PeerUnavailable, TransferError, TransferFailed
from libs.transfer.nixl_package import nixl_module
from libs.transfer.pool import MemoryPool, Slot

_log = structlog.get_logger(__name__)

# (address, length) of one contiguous range.
Range = tuple[int, int]
# Called with (sending agent name, message) for every notification received.
NotificationHandler = Callable[[str, bytes], None]
# Called on every tick of the service thread with time.monotonic(); returns True while it has
# work outstanding that needs fast polling (e.g. leases awaiting acks).
PeriodicTask = Callable[[float], bool]

# UCX reads its environment when NIXL creates the backend: serialize env + creation.
_CREATE_LOCK = threading.Lock()


class ReadState:
    DONE = "DONE"
    IN_PROGRESS = "PROC"
    ERROR = "ERR"


@dataclasses.dataclass
class PendingRead:
    """A posted NIXL READ; `xfer` is NIXL's handle, released exactly once."""

    peer: str
    xfer: Any
    state: str = "PROC"  # last state seen: DONE, PROC or ERR
    released: bool = False


@dataclasses.dataclass
class _Quarantined:
    slot: Slot
    read: PendingRead | None
    release_at: float


class TransferAgent:
    """One NIXL agent + registered pool + service thread. Use as a context manager or `close()`."""

    def __init__(self, config: TransferConfig | None = None) -> None:
        self.config = config or TransferConfig()
        self.instance_id = uuid.uuid4().hex
        self.name = f"{self.config.agent_name_prefix}-{os.getpid()}-{self.instance_id[:8]}"
        self.pool = MemoryPool(
            self.config.pool_bytes, huge_pages=self.config.huge_pages, shared=self.config.shared_pool
        )
        try:
            self._nixl = _create_nixl_agent(
                self.name, self.config.ucx_environment(), self.config.progress_thread_wakeup_s
            )
            self._registration = self._nixl.register_memory(
                [(self.pool.base_address, self.pool.capacity, 0, "")], "DRAM"
            )
            self.metadata: bytes = bytes(self._nixl.get_agent_metadata())
        except Exception:
            self.pool.close()
            raise
        self._errors = _nixl_errors()
        self._closed = False
        self._handlers: list[NotificationHandler] = []
        self._tasks: list[PeriodicTask] = []
        self._quarantine: list[_Quarantined] = []
        self._acks: collections.deque[tuple[str, bytes]] = collections.deque()
        self._state_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"transfer-{self.name}", daemon=True)
        self._thread.start()

    # --- identity ------------------------------------------------------------------------------

    def agent_info(self) -> service_info_pb2.NixlAgentInfo:
        """What a service advertises in `ServiceInfo.transports[].nixl`."""
        return service_info_pb2.NixlAgentInfo(
            agent_name=self.name, instance_id=self.instance_id, metadata=self.metadata
        )

    def agent_ref(self, producer_address: str) -> tensor_pb2.NixlAgentRef:
        """How handles name this agent; `producer_address` serves ServiceInfo and LeaseService."""
        return tensor_pb2.NixlAgentRef(
            agent_name=self.name, instance_id=self.instance_id, producer_address=producer_address
        )

    # --- service thread hooks ------------------------------------------------------------------

    def on_notification(self, handler: NotificationHandler) -> None:
        with self._state_lock:
            self._handlers.append(handler)

    def add_periodic(self, task: PeriodicTask) -> None:
        with self._state_lock:
            self._tasks.append(task)

    def wake(self) -> None:
        """Make the service thread tick now (e.g. a lease was just published: poll fast)."""
        self._wake.set()

    def quarantine(self, slot: Slot, read: PendingRead | None) -> None:
        """Keep `slot` out of the pool for `quarantine_s`, and until `read` is released."""
        self.pool.quarantine(slot)
        with self._state_lock:
            self._quarantine.append(_Quarantined(slot, read, time.monotonic() + self.config.quarantine_s))

    # --- NIXL operations -----------------------------------------------------------------------

    def load_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata blob; returns the agent name it describes."""
        self._check_open()
        try:
            name = self._nixl.add_remote_agent(metadata)
        except Exception as exc:
            raise PeerUnavailable(f"cannot load agent metadata ({len(metadata)} bytes): {exc}") from exc
        return name.decode() if isinstance(name, bytes) else str(name)

    def forget_peer(self, name: str) -> None:
        """Drop a peer's metadata and connection (it died or restarted). Never raises."""
        if self._closed:
            return
        try:
            self._nixl.remove_remote_agent(name)
        except Exception as exc:
            _log.debug("forget_peer failed", peer=name, error=str(exc))

    def knows_peer(self, name: str) -> bool:
        self._check_open()
        return bool(self._nixl.check_remote_metadata(name))

    def start_read(self, peer: str, local: Sequence[Range], remote: Sequence[Range]) -> PendingRead:
        """Post one READ of every `remote` range of `peer` into the matching `local` range.

        Raises `DescriptorOutOfBounds`-worthy NIXL errors as `LookupError` (the caller knows whether
        the peer is loaded), a dead peer as `PeerUnavailable`, anything else as `TransferFailed`.
        """
        self._check_open()
        try:
            local_descs = self._nixl.get_xfer_descs(_descriptors(local), "DRAM")
            remote_descs = self._nixl.get_xfer_descs(_descriptors(remote), "DRAM")
            xfer = self._nixl.initialize_xfer("READ", local_descs, remote_descs, peer, b"")
        except self._errors.not_found as exc:
            raise LookupError(str(exc)) from exc
        except Exception as exc:
            raise self._translate(exc, peer, "prepare READ") from exc
        read = PendingRead(peer=peer, xfer=xfer)
        try:
            state = self._nixl.transfer(xfer)
        except Exception as exc:
            self.cancel(read)
            raise self._translate(exc, peer, "post READ") from exc
        if state == ReadState.ERROR:
            self.cancel(read)
            raise PeerUnavailable(f"READ from agent {peer} failed when posted")
        read.state = str(state)
        return read

    def poll(self, read: PendingRead) -> str:
        """One non-blocking progress + state check: DONE, PROC or ERR (also stored in `read.state`)."""
        self._check_open()
        if read.state != ReadState.IN_PROGRESS:
            return read.state
        try:
            read.state = str(self._nixl.check_xfer_state(read.xfer))
        except Exception as exc:
            _log.debug("check_xfer_state raised", peer=read.peer, error=str(exc))
            read.state = ReadState.ERROR
        return read.state

    def cancel(self, read: PendingRead) -> bool:
        """Release a READ's NIXL handle (cancelling it if still running). True when released."""
        if read.released:
            return True
        if self._closed:
            return False
        try:
            self._nixl.release_xfer_handle(read.xfer)
        except Exception as exc:
            _log.debug("release_xfer_handle failed", peer=read.peer, error=str(exc))
            return False
        read.released = True
        return True

    def notify_soon(self, peer: str, message: bytes) -> None:
        """Have the service thread send a notification (`notify`) right away, off the caller's path.
        Sent in the order queued; pending ones are still sent by `close()`."""
        self._acks.append((peer, message))
        self._wake.set()

    def notify(self, peer: str, message: bytes) -> bool:
        """Send a notification; False (logged) if the peer is gone, which the caller may ignore."""
        if self._closed:
            return False
        try:
            self._nixl.send_notif(peer, message)
        except Exception as exc:
            _log.warning("notification not delivered", peer=peer, error=str(exc))
            return False
        return True

    # --- lifecycle -----------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop the service thread, deregister and unmap the pool. Idempotent."""
        if self._closed:
            return
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        self._send_queued()
        with self._state_lock:
            for entry in self._quarantine:
                if entry.read is not None:
                    self.cancel(entry.read)
            self._quarantine.clear()
        self._closed = True
        try:
            self._nixl.deregister_memory(self._registration)
        except Exception as exc:
            _log.warning("deregister_memory failed", error=str(exc))
        del self._nixl
        self.pool.close()

    def __enter__(self) -> TransferAgent:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- internals -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise AgentClosed(f"transfer agent {self.name} is closed")

    def _translate(self, exc: Exception, peer: str, what: str) -> TransferError:
        if isinstance(exc, TransferError):
            return exc
        if isinstance(exc, self._errors.disconnected):
            return PeerUnavailable(f"agent {peer} disconnected ({what}): {exc}")
        return TransferFailed(f"{what} with agent {peer} failed: {type(exc).__name__}: {exc}")

    def _serve(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            try:
                busy = self._tick()
            except Exception:
                _log.exception("transfer service tick failed")
                busy = True
            self._wake.wait(self.config.busy_poll_s if busy else self.config.idle_poll_s)

    def _send_queued(self) -> None:
        while True:
            try:
                peer, message = self._acks.popleft()
            except IndexError:  # empty (close() and a late tick may drain it together)
                return
            self.notify(peer, message)

    def _tick(self) -> bool:
        self._send_queued()
        for peer, messages in self._nixl.get_new_notifs().items():
            sender = peer.decode() if isinstance(peer, bytes) else str(peer)
            for message in messages:
                for handler in list(self._handlers):
                    handler(sender, bytes(message))
        now = time.monotonic()
        busy = False
        for task in list(self._tasks):
            busy = task(now) or busy
        self._sweep_quarantine(now)
        return busy

    def _sweep_quarantine(self, now: float) -> None:
        with self._state_lock:
            due = [q for q in self._quarantine if q.release_at <= now]
            for entry in due:
                if entry.read is not None and not self.cancel(entry.read):
                    continue  # NIXL still owns the buffer: keep it out of the pool
                self._quarantine.remove(entry)
                self.pool.release_quarantined(entry.slot, poison=self.config.poison_freed)


@dataclasses.dataclass(frozen=True)
class _NixlErrors:
    not_found: type[Exception]
    disconnected: type[Exception]


def _nixl_errors() -> _NixlErrors:
    bindings = nixl_module("_bindings")  # compiled, no type stubs
    return _NixlErrors(not_found=bindings.nixlNotFoundError, disconnected=bindings.nixlRemoteDisconnectError)


def _descriptors(ranges: Sequence[Range]) -> list[tuple[int, int, int]]:
    # (address, length, device id) tuples go straight to NIXL's binding; a numpy array would be
    # built element by element here and cost more than the descriptor list itself.
    return [(address, length, 0) for address, length in ranges]


def _create_nixl_agent(name: str, env: dict[str, str], progress_wakeup_s: float | None) -> Any:
    # UCX reads its variables while NIXL creates the backend; restore them afterwards so a second
    # agent (tests) gets its own settings, not ours.
    with _CREATE_LOCK:
        saved = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        try:
            return _new_ucx_agent(name, progress_wakeup_s)
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def _new_ucx_agent(name: str, progress_wakeup_s: float | None) -> Any:
    api = nixl_module("_api")
    config = api.nixl_agent_config(
        enable_prog_thread=progress_wakeup_s is not None,
        enable_listen_thread=False,  # metadata travels in ServiceInfo, not NIXL's listener
        backends=["UCX"],
        sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
    )
    # The Python API pins the progress thread's poll() timeout (pthrDelay) to 0, which makes it spin
    # a core. With a timeout it sleeps on the UCX workers' event fds and wakes on traffic: it answers a
    # peer's flush at once (else a READ issued after we sent a notification waits for our next poll).
    real_agent = api.nixlBind.nixlAgent

    def with_wakeup(agent_name: str, agent_config: Any) -> Any:
        agent_config.pthrDelay = int((progress_wakeup_s or 0) * 1e6)
        return real_agent(agent_name, agent_config)

    api.nixlBind.nixlAgent = with_wakeup
    try:
        agent = api.nixl_agent(name, config)
    finally:
        api.nixlBind.nixlAgent = real_agent
    if "UCX" not in agent.backends:
        raise TransferFailed("NIXL's UCX backend is not available in this process")
    return agent
