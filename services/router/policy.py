"""What a failed stage call means to the router, and how far a call moves between members on it.

A failure's `Meaning` is read from the failure reason the peer sent (`libs.contract.reasons`), in
`BY_REASON`. A peer that sends none (older minor contract versions; any error that did not come
from an EPD handler, e.g. a peer that cannot be reached) gets `fallback`: what the stage, the
status code and the "draining" detail (`libs.rpc.retry.stopping`) meant before reasons existed.

The router acts on a meaning in two places:
- per call (`services/router/failover.py`): `leaving` passes the member over until membership
  drops it, `elsewhere` retries on a member not tried yet (within the stage's `Retries`), and
  `wait` waits out a stage whose every member is leaving (a rolling restart);
- per request (`services/router/core.py`): `reencode` encodes again once when prefill found an
  embedding gone before any token was streamed; `recompute` prefills again once when decode found
  the KV gone before reading it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import grpc

from libs.contract.errors import EpdError
from libs.contract.reasons import Reason, reason_of
from libs.rpc.retry import stopping

# A stage as the policy sees it: "pd" is the PD member's call (E+PD), which fails the request as
# "prefill" before its first token and as "decode" after it.
Stage = Literal["encode", "prefill", "decode", "pd"]


@dataclass(frozen=True)
class Meaning:
    """What one failure says about the member and the request (every flag off: give up)."""

    leaving: bool = False  # the member drains or stopped: pass it over while another is left
    elsewhere: bool = False  # another member may not share the failure: retry on one not tried
    wait: bool = False  # when no other member is left: wait for one to take work again
    reencode: bool = False  # (prefill) an embedding it should read is gone: encode again, once
    recompute: bool = False  # (decode, nothing read yet) its KV is gone: prefill again, once
    held_miss: bool = False  # (prefill) an item sent as held is not in its prefix cache: encode it


_LEAVING = Meaning(leaving=True, elsewhere=True, wait=True)

BY_REASON: dict[Reason, Meaning] = {
    Reason.DRAINING: _LEAVING,
    Reason.SERVER_STOPPED: _LEAVING,
    # Comes back in place (its supervisor restarts the engine): others meanwhile, else wait for it.
    Reason.ENGINE_RESTARTING: Meaning(elsewhere=True, wait=True),
    # Another prefill would not find it either: encode again at once.
    Reason.EMBEDDING_GONE: Meaning(reencode=True),
    Reason.KV_GONE: Meaning(recompute=True),
    # Not a failure of the request: the router's guess of what the member holds was stale.
    Reason.EMBEDDING_NEEDED: Meaning(held_miss=True),
    # Backing off is the client's call (its own retry policy), as for RESOURCE_EXHAUSTED before.
    Reason.OVERLOADED: Meaning(),
}

# Reason-less encoder failures worth another encoder; anything else (bad media) goes to the client.
# CANCELLED: the encoder stopped before handling the job (libs/rpc/retry.py).
_ENCODE_ELSEWHERE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.CANCELLED,
}
# A prefill, decode or PD member's reason-less refusals before its first token that another member
# may not share (it drains, stopped, or cannot be reached).
_MEMBER_ELSEWHERE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}
# Reason-less prefill failures meaning "an embedding is gone" (expired, encoder restarted or dead,
# slot reclaimed and reused).
_EMBEDDING_GONE = {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS}
# Reason-less decode failures meaning "the KV it was handed is gone" (lease expired, e.g. while the
# router waited out a decode restart; slot reclaimed).
_KV_GONE = {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DATA_LOSS}


def fallback(stage: Stage, code: grpc.StatusCode, details: str | None) -> Meaning:
    """The meaning of a failure that carries no reason: from its stage, code and details."""
    going = stopping(code, details)
    return Meaning(
        leaving=going,
        elsewhere=code in (_ENCODE_ELSEWHERE if stage == "encode" else _MEMBER_ELSEWHERE),
        wait=going,
        reencode=stage == "prefill" and code in _EMBEDDING_GONE,
        recompute=stage == "decode" and code in _KV_GONE,
    )


def meaning_of(stage: Stage, reason: Reason | None, code: grpc.StatusCode, details: str | None) -> Meaning:
    """The table's meaning of `reason`; the fallback's when the peer sent none."""
    return fallback(stage, code, details) if reason is None else BY_REASON[reason]


def meaning(stage: Stage, error: grpc.aio.AioRpcError) -> Meaning:
    """What `error`, from a call to `stage`, means."""
    return meaning_of(stage, reason_of(error), error.code(), error.details())


@dataclass(frozen=True)
class Retries:
    """How far one stage's call moves between members on failures that allow it."""

    elsewhere: int | None  # other members one call may move to; None: every one not tried yet
    avoid_s: float | None  # how long a member the call left is passed over; None: not at all
    wait_for_members: bool  # whether a stage with no member now is waited for (discovered pools)


# One retry on another encoder: a bad item should not visit every encoder.
ENCODE_RETRIES = Retries(elsewhere=1, avoid_s=None, wait_for_members=False)
# Any member not tried yet; an unreachable one fails fast, so it would look the least loaded and
# draw every pick: it is passed over a while (a draining one until membership drops it).
MEMBER_RETRIES = Retries(elsewhere=None, avoid_s=5.0, wait_for_members=True)


class RpcFailed(EpdError):
    """A stage answered with a non-OK status; re-raised to the client with the same code."""

    def __init__(
        self, stage: str, code: grpc.StatusCode, details: str, meaning: Meaning, kv_unread: bool = False
    ) -> None:
        super().__init__(f"{stage}: {details}")
        self.code = code  # type: ignore[misc]  # instance-level code: mirrors the backend's status
        self.stage = stage
        self.meaning = meaning
        self.kv_unread = kv_unread  # decode failed before streaming anything: the KV is unused

    @classmethod
    def of(cls, stage: Literal["encode", "prefill", "decode"], error: grpc.aio.AioRpcError, **kw: bool) -> RpcFailed:
        """The failure of a call to `stage` that ended with `error`."""
        return cls(stage, error.code(), error.details() or error.code().name, meaning(stage, error), **kw)

    @classmethod
    def here(cls, stage: Literal["encode", "prefill", "decode"], code: grpc.StatusCode, details: str) -> RpcFailed:
        """A failure the router finds in a stage's answer (no peer reason)."""
        return cls(stage, code, details, fallback(stage, code, details))

    @property
    def embedding_gone(self) -> bool:
        return self.stage == "prefill" and self.meaning.reencode

    @property
    def held_miss(self) -> bool:
        return self.stage == "prefill" and self.meaning.held_miss

    @property
    def kv_gone(self) -> bool:
        return self.stage == "decode" and self.kv_unread and self.meaning.recompute
