"""How the router reaches its stages: stubs per address (`StageStubs`), the first-contact checks
every member passes before its first call (`Checks`; services/router/handshake.py's
`PeerChecks` in the service, a double that passes everyone in tests), and the members of the
prefill, decode and PD stages (`Stages`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from libs.contract import validation
from libs.contract.epd.v1 import chat_pb2, sampling_pb2, service_info_pb2
from libs.contract.errors import InvalidArgument
from libs.rpc.admission import CAPABILITY as ADMISSION_PRIORITY
from services.router.pool import MemberPool


class Checks(Protocol):
    """First-contact checks of the router's peers; each raises FailedPrecondition for a peer that
    cannot serve this stack and Unavailable for one that cannot be reached."""

    async def backend(self) -> service_info_pb2.ServiceInfo:
        """The prefill/decode (or PD) side as a whole: its checked info (a prefill's or PD's)."""
        ...

    async def encoder(self, address: str, instance_id: str | None = None) -> None:
        """An encoder (re-checked when a handle names a new incarnation `instance_id`)."""
        ...

    async def prefill(self, address: str) -> None:
        """One prefill (or PD) member."""
        ...

    async def decode(self, address: str, prefill_address: str) -> None:
        """One decode member, for the KV of the prefill at `prefill_address`."""
        ...

    def honors(self, address: str, capability: str) -> bool:
        """Whether the (checked) peer advertises a capability (features are negotiated this way)."""
        ...

    def encoder_cache(self, address: str) -> service_info_pb2.EncoderCacheInfo | None:
        """The (checked) encoder's cache, as advertised in its ServiceInfo; None when it keeps none."""
        ...

    def max_running(self, address: str) -> int | None:
        """The requests the (checked) peer runs at once, as advertised (0: not advertised, a peer
        before contract 1.7); None before first contact."""
        ...


@dataclass
class StageStubs:
    """How the router reaches each stage: address -> stub, for any member of that stage's pool.
    `lease(address)` reaches any producer's LeaseService."""

    encoder: Callable[[str], Any]  # address -> EncoderServiceStub
    lease: Callable[[str], Any]  # address -> LeaseServiceStub
    checks: Checks
    prefill: Callable[[str], Any] | None = None  # address -> PrefillServiceStub (E/P/D)
    decode: Callable[[str], Any] | None = None  # address -> DecodeServiceStub (E/P/D)
    prefill_decode: Callable[[str], Any] | None = None  # address -> PrefillDecodeServiceStub (E+PD)

    def __post_init__(self) -> None:
        if self.prefill_decode is None and (self.prefill is None or self.decode is None):
            raise ValueError("need prefill and decode stubs (E/P/D) or a prefill-decode stub (E+PD)")

    def check_sampling(self, address: str, stage: str, sampling: sampling_pb2.SamplingParams) -> None:
        """Refuse a request whose sampling sets a contract-1.6 field for a peer that does not
        advertise `sampling.openai`: a peer of an older minor would parse it as an unknown field and
        silently ignore it (features by capability, never by comparing minors)."""
        field = validation.uses_since_1_6(sampling)
        if field is not None and not self.checks.honors(address, validation.SAMPLING_CAPABILITY):
            raise InvalidArgument(
                f"sampling.{field}",
                f"the {stage} service at {address} does not advertise {validation.SAMPLING_CAPABILITY} "
                "(contract 1.6): it would ignore the field",
            )

    def check_prompt(self, address: str, stage: str, messages: Sequence[chat_pb2.ChatMessage]) -> None:
        """Refuse a raw prompt (CHAT_ROLE_RAW, contract 1.6) for a peer that does not advertise
        `prompt.raw`: an older one would refuse the role or, worse, template it."""
        if validation.raw_prompt(messages) and not self.checks.honors(address, validation.RAW_PROMPT_CAPABILITY):
            raise InvalidArgument(
                "messages[0].role",
                f"the {stage} service at {address} does not advertise {validation.RAW_PROMPT_CAPABILITY} "
                "(contract 1.6): it cannot take a raw prompt",
            )

    def priority_for(self, address: str, priority: int) -> int:
        """The request's priority for a peer that honors it (contract 1.1), else the default."""
        return priority if self.checks.honors(address, ADMISSION_PRIORITY) else 0


@dataclass
class Stages:
    """The members of the prefill, decode and PD stages (services/router/pool.py); a stage whose
    stub is not in `StageStubs` has none. Read at each call: members may be replaced while running."""

    prefill: MemberPool | None = None
    decode: MemberPool | None = None
    pd: MemberPool | None = None

    @classmethod
    def one_each(cls, stubs: StageStubs) -> Stages:
        """One member per stage the stubs reach, its address the stage's name: the pools of a
        `Router` given none (a core over stubs that take any address, as the test doubles do)."""

        def one(stage: str, stub: object) -> MemberPool | None:
            return None if stub is None else MemberPool([stage], stage=stage)

        return cls(one("prefill", stubs.prefill), one("decode", stubs.decode), one("pd", stubs.prefill_decode))
