"""Configuration of a process's transfer agent, pool, leases and deadlines.

One `TransferConfig` per process, given to `TransferAgent`. Plain values only, so a service can
fill it from its settings. The UCX / NIXL environment (`ucx_environment`) is applied by the agent
just before NIXL creates its UCX context, which reads it once.
"""

from __future__ import annotations

import dataclasses

MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class TransferConfig:
    """Knobs of the transport. Defaults suit one service on one host (loopback)."""

    # Prefix of the NIXL agent name; the agent appends pid and incarnation so names never repeat.
    agent_name_prefix: str = "epd"
    # Size of the registered pool, in bytes. Committed (populated) at start-up.
    pool_bytes: int = 256 * MiB
    # Back the pool with transparent huge pages: UCX's cross-memory-attach reads run faster (fewer
    # page walks; docs/results/transfer.md).
    huge_pages: bool = True
    # Back the pool with a memfd another process maps to write tensors in place (pool.py).
    shared_pool: bool = False
    # How long a producer keeps an un-acked lease before reclaiming its slots, in seconds.
    lease_ttl_s: float = 30.0
    # Default deadline of one consumer READ (all tensors of the handles fetched together), seconds.
    transfer_timeout_s: float = 10.0
    # A consumer refuses handles whose lease ends sooner than this (clock skew, read time), seconds.
    min_lease_remaining_s: float = 0.05
    # How long a slot whose READ timed out stays out of the pool, in seconds.
    quarantine_s: float = 30.0
    # Largest total payload of one INLINE handle, in bytes (it rides inside a gRPC message).
    inline_max_bytes: int = 1 * MiB
    # Consumer: take INLINE handles at all. Their bytes come from the caller, not from a producer's
    # memory, so only callers that are authenticated (mutual TLS) should be able to send them.
    accept_inline: bool = False
    # Producer: attach a CRC32 of every tensor to its descriptor.
    checksum: bool = False
    # Consumer: verify a descriptor's checksum when one is attached.
    verify_checksum: bool = True
    # Producer: overwrite a slot with a pattern when it returns to the pool, so a stale read shows.
    poison_freed: bool = False
    # NIXL's UCX progress thread sleeps on the workers' event fds and wakes on traffic or after this
    # many seconds. It must run: a peer's READ issued after we exchanged a notification completes
    # only once we progress (UCX flushes the TCP lane). None: no progress thread.
    progress_thread_wakeup_s: float | None = 0.01
    # Notification polling period while leases or quarantined slots are outstanding, seconds.
    busy_poll_s: float = 0.001
    # Polling period when nothing is outstanding (keeps an idle agent near 0% CPU), seconds.
    idle_poll_s: float = 0.02
    # UCX_NET_DEVICES: "lo" confines UCX's network transports to loopback; None leaves it alone.
    ucx_net_devices: str | None = "lo"
    # UCX_MODULES: "^ib" keeps UCX's InfiniBand modules out. Where libibverbs is installed (Mooncake
    # needs it) but no RDMA device exists, they load anyway and crash the process at exit (SIGSEGV);
    # reads between host processes go by CMA or TCP. None leaves it alone.
    ucx_modules: str | None = "^ib"
    # Further UCX_* / NIXL_* variables for the agent's UCX context, e.g. (("UCX_TLS", "tcp"),).
    extra_env: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        positive = {
            "pool_bytes": self.pool_bytes,
            "lease_ttl_s": self.lease_ttl_s,
            "transfer_timeout_s": self.transfer_timeout_s,
            "busy_poll_s": self.busy_poll_s,
            "idle_poll_s": self.idle_poll_s,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"TransferConfig.{name} must be > 0, got {value}")
        for name, value in {
            "quarantine_s": self.quarantine_s,
            "inline_max_bytes": self.inline_max_bytes,
            "min_lease_remaining_s": self.min_lease_remaining_s,
        }.items():
            if value < 0:
                raise ValueError(f"TransferConfig.{name} must be >= 0, got {value}")
        if self.progress_thread_wakeup_s is not None and self.progress_thread_wakeup_s < 0.001:
            raise ValueError("TransferConfig.progress_thread_wakeup_s must be >= 0.001 (0 makes NIXL spin)")
        if not self.agent_name_prefix:
            raise ValueError("TransferConfig.agent_name_prefix must not be empty")

    def ucx_environment(self) -> dict[str, str]:
        """Environment the agent sets before creating its UCX context."""
        env = {"NIXL_LOG_LEVEL": "WARN"}
        if self.ucx_net_devices is not None:
            env["UCX_NET_DEVICES"] = self.ucx_net_devices
        if self.ucx_modules is not None:
            env["UCX_MODULES"] = self.ucx_modules
        env.update(dict(self.extra_env))
        return env
