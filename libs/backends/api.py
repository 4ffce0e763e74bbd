"""What a model service sees of its engine, whichever it is: one backend protocol per role.

A service picks its backend with `--engine reference|vllm` (`EPD_ENGINE`; the colocated service
runs the reference runtime only) through `libs.backends.registry`, and
advertises what the backend reports in `ServiceInfo` (`capabilities()`, `embedding_specs()`,
`extend_info()`; vLLM as `engine.vllm`, so a peer checks at first contact that it can hand over
to it: embeddings are engine-neutral, a KV cache is not).

One type vocabulary for every role: the role's epd.v1 request, already validated by the service's
core (`libs.contract.validation`), goes in; the role's epd.v1 response (or stream of responses)
comes out; failures are typed contract errors (`libs.contract.errors`). What happens in between
(the reference runtime's transport and compute thread, vLLM's worker and connectors) is the
backend's.

| role | protocol | call |
|---|---|---|
| encoder (E) | `EncoderBackend` | `encode(EncodeRequest, deadline) -> EncodeResponse` |
| prefill (P) | `PrefillBackend` | `prefill(PrefillRequest, deadline) -> PrefillResponse` |
| decode (D) | `DecodeBackend` | `decode(DecodeRequest, deadline) -> AsyncIterator[DecodeResponse]` |
| PD (E+PD) | `PrefillDecodeBackend` | `generate(PrefillDecodeRequest, ...) -> AsyncIterator[PrefillDecodeResponse]` |
| colocated | `ColocatedBackend` | `generate(GenerateRequest, deadline) -> AsyncIterator[GenerateResponse]` |

`deadline` is `time.monotonic()` seconds (None: none).

Who calls what, where (like vLLM's KV-connector base class, which says which process runs which
method): every method below is called in the service's own process, on its asyncio event-loop
thread (the gRPC aio server's), never concurrently with `close`:

- `start(settings)` (the module-level factory the registry returns): once, by the service's
  `setup` before the server listens; it loads the model or starts the engine.
- `embedding_specs`, `capabilities`, `extend_info`, `max_running`: once, while the service builds
  its `ServiceInfo` and admission.
- `watch_health(setter)`: once, when the server serves; a backend whose engine can die and come
  back (vLLM) reports SERVING / NOT_SERVING through `setter`.
- `watch_fatal(fail)`: once, when the server serves; `fail(reason)` ends the service with an
  error (vLLM: its engine failed more often than its restart bound allows).
- `serving_at(address)`: once, when the server is bound (producers put the address into handles).
- the role's call: per request, in the task of the gRPC handler that admitted it. The work runs
  off the loop: the reference runtime on its one `ComputeThread` (model code) and its transport's
  thread pool (NIXL), vLLM in its EngineCore and Worker processes (whose EC / KV connectors run
  there, see `vllm/ec_connector.py`, `vllm/kv_connector.py`).
- `abort(request_id)`: from any task on the loop. It cancels the calls in flight for that id, as a
  client's cancel does: every backend gives back what a cancelled call holds (slots, leases, its
  place in the decode batch; vLLM aborts the request in its engine). The reference runtime cannot
  interrupt one forward pass: the request ends at the next step boundary.
- `active`, the `transport`'s and `leases`' counters: at any time (stats, drain).
- `close()`: once, after the drain, at shutdown.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Protocol

from libs.backends.engines import ENGINES, capability, engine_capabilities, engine_of
from libs.backends.in_flight import InFlight
from libs.contract.epd.v1 import (
    decode_pb2,
    encoder_pb2,
    generate_pb2,
    prefill_decode_pb2,
    prefill_pb2,
    service_info_pb2,
    stats_pb2,
)
from libs.model import types as eng
from libs.serving.transport import Transport

__all__ = [
    "ENGINES",
    "Backend",
    "ColocatedBackend",
    "DecodeBackend",
    "EncoderBackend",
    "EngineLeases",
    "HealthSetter",
    "PrefillBackend",
    "PrefillDecodeBackend",
    "capability",
    "engine_capabilities",
    "engine_of",
]

HealthSetter = Callable[[bool], Awaitable[None]]


class EngineLeases(Protocol):
    """Tensors an engine holds for consumers outside the service's transport (vLLM's paged KV
    blocks kept for decode), with the same lease rules."""

    def held(self) -> int: ...

    async def release(self, lease_ids: Sequence[str]) -> int: ...

    async def pool_stats(self) -> stats_pb2.TransferPoolStats: ...


class Backend(Protocol):
    """The lifecycle every role's backend has. Implementations subclass their role's protocol, so
    the defaults below apply where a backend has nothing to add."""

    name: str  # "reference" | "vllm"
    weights_digest: str  # the checkpoint digest every role advertises
    max_running: int  # requests it runs at once; the rest wait in the service's admission
    in_flight: InFlight  # the calls `abort` can reach
    # The service's tensor transport when the backend moves tensors with it (the reference
    # runtime): its leases, stats and drain are the service's.
    transport: Transport | None = None
    # Tensors the engine itself holds for consumers (vLLM prefill's KV blocks).
    leases: EngineLeases | None = None

    @property
    def active(self) -> int:
        """Sequences being generated (0 for roles that generate none)."""
        return 0

    def embedding_specs(self) -> list[eng.EmbeddingSpec]:
        """Per-modality embeddings it produces (encoder) or consumes (prefill, PD); none for decode."""
        return []

    def capabilities(self) -> tuple[str, ...]:
        """What it advertises in `ServiceInfo.capabilities` besides admission priority (the
        transport's own are added by the service)."""
        return ()

    def extend_info(self, info: service_info_pb2.ServiceInfo) -> None:
        """Role-specific `ServiceInfo` fields (a transcription spec, the encoder cache)."""
        return None

    def watch_health(self, setter: HealthSetter) -> None:
        """Given the server's health setter once it serves (engines that cannot die ignore it)."""
        return None

    def watch_fatal(self, fail: Callable[[str], None]) -> None:
        """Given, once it serves, what ends the service with an error (exit non-zero): a backend
        whose engine cannot be brought back (vLLM past its restart bound) calls it with the reason."""
        return None

    def serving_at(self, address: str) -> None:
        """The address the server is bound to."""
        if self.transport is not None:
            self.transport.bind_address(address)

    async def abort(self, request_id: str) -> bool:
        """Cancel the calls in flight for `request_id`; False when there were none."""
        return self.in_flight.cancel(request_id)

    async def close(self) -> None:
        """Stop the engine and free what it holds (the transport included)."""
        ...


class EncoderBackend(Backend, Protocol):
    """Media items -> embeddings held for prefill to read (the E role)."""

    async def encode(
        self, request: encoder_pb2.EncodeRequest, deadline: float | None
    ) -> encoder_pb2.EncodeResponse: ...


class PrefillBackend(Backend, Protocol):
    """Prefill of metadata-only requests (the P role): the first token and the KV handoff."""

    async def prefill(
        self, request: prefill_pb2.PrefillRequest, deadline: float | None
    ) -> prefill_pb2.PrefillResponse: ...


class DecodeBackend(Backend, Protocol):
    """Decode from a prefill's KV handoff (the D role): the token stream."""

    def decode(
        self, request: decode_pb2.DecodeRequest, deadline: float | None
    ) -> AsyncIterator[decode_pb2.DecodeResponse]: ...


class PrefillDecodeBackend(Backend, Protocol):
    """Prefill + decode of metadata-only requests in one service (the PD role): `priority`
    (epd.v1's: higher first) orders the requests waiting inside an engine that queues them."""

    def generate(
        self, request: prefill_decode_pb2.PrefillDecodeRequest, deadline: float | None
    ) -> AsyncIterator[prefill_decode_pb2.PrefillDecodeResponse]: ...


class ColocatedBackend(Backend, Protocol):
    """Encode, prefill and decode of a client's request in one process, no transfers (the
    baseline every other layout equals token for token)."""

    def generate(
        self, request: generate_pb2.GenerateRequest, deadline: float | None
    ) -> AsyncIterator[generate_pb2.GenerateResponse]: ...
