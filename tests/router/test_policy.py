"""The router's failure policy (services/router/policy.py) with constructed errors: the table keyed
by reason, and the fallback for a peer that sends none, which must make exactly the decisions the
router made before reasons existed (stage + status code + the "draining" detail)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from libs.contract.reasons import Reason
from libs.rpc.retry import DRAINING
from services.router import policy
from services.router.policy import BY_REASON, Meaning, Stage, fallback, meaning
from services.router.pool import MemberPool
from tests.support.router_harness import Harness, image_request, rpc_error

pytestmark = pytest.mark.unit

STAGES: list[Stage] = ["encode", "prefill", "decode", "pd"]
CODES = [c for c in grpc.StatusCode if c != grpc.StatusCode.OK]
DETAILS = ["boom", f"the service is {DRAINING} for shutdown", "", None]

# What the router decided before failure reasons, spelled out: its status-code sets, verbatim.
_RETRYABLE_ENCODE = {"UNAVAILABLE", "DEADLINE_EXCEEDED", "INTERNAL", "CANCELLED"}
_MEMBER_GONE = {"UNAVAILABLE", "CANCELLED"}
_EMBEDDING_GONE = {"NOT_FOUND", "UNAVAILABLE", "DATA_LOSS"}
_KV_GONE = {"NOT_FOUND", "DATA_LOSS"}


def _stopping(code: grpc.StatusCode, details: str | None) -> bool:
    return code.name == "CANCELLED" or (code.name == "UNAVAILABLE" and "draining" in (details or ""))


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("details", DETAILS)
def test_without_a_reason_every_code_means_what_it_meant_before(stage: Stage, details: str | None) -> None:
    for code in CODES:
        expected = Meaning(
            leaving=_stopping(code, details),
            elsewhere=code.name in (_RETRYABLE_ENCODE if stage == "encode" else _MEMBER_GONE),
            wait=_stopping(code, details),
            reencode=stage == "prefill" and code.name in _EMBEDDING_GONE,
            recompute=stage == "decode" and code.name in _KV_GONE,
        )
        assert fallback(stage, code, details) == expected, (stage, code, details)
        assert meaning(stage, rpc_error(code, details or "")) == fallback(stage, code, details or "")


def test_every_reason_has_a_meaning() -> None:
    assert set(BY_REASON) == set(Reason)
    assert BY_REASON[Reason.DRAINING] == BY_REASON[Reason.SERVER_STOPPED] == Meaning(True, True, True)
    assert BY_REASON[Reason.ENGINE_RESTARTING] == Meaning(elsewhere=True, wait=True)  # back in place
    assert BY_REASON[Reason.EMBEDDING_GONE] == Meaning(reencode=True)
    assert BY_REASON[Reason.KV_GONE] == Meaning(recompute=True)
    assert BY_REASON[Reason.OVERLOADED] == Meaning()  # to the client, as RESOURCE_EXHAUSTED was


def _reasons_from_details(monkeypatch: pytest.MonkeyPatch) -> None:
    """Peers that send reasons: here the reason rides in the details (what `reason_of` reads on
    the wire is libs/contract/reasons.py's business; the policy only sees its answer)."""

    def reason_of(error: grpc.aio.AioRpcError) -> Reason | None:
        name = (error.details() or "").partition(":")[0]
        return Reason(name) if name in Reason.__members__ else None

    monkeypatch.setattr(policy, "reason_of", reason_of)


@pytest.mark.parametrize("reason", list(Reason))
def test_a_reason_decides_whatever_the_code_and_details(monkeypatch: pytest.MonkeyPatch, reason: Reason) -> None:
    _reasons_from_details(monkeypatch)
    for stage in STAGES:
        for code in CODES:
            assert meaning(stage, rpc_error(code, f"{reason.value}: {DRAINING}")) == BY_REASON[reason]
    assert meaning("prefill", rpc_error(grpc.StatusCode.UNAVAILABLE, "no reason")).reencode  # fallback


def test_a_reasoned_embedding_gone_reencodes_without_trying_another_prefill(monkeypatch: pytest.MonkeyPatch) -> None:
    _reasons_from_details(monkeypatch)
    h = Harness()
    h.stages.prefill = members = MemberPool(["p0:1", "p1:1"], stage="prefill")
    tried: list[str] = []
    real = h.prefill.Prefill

    def prefill_for(address: str) -> Any:
        async def call(request: Any, timeout: float | None = None, **kw: Any) -> Any:
            tried.append(address)
            if len(tried) == 1:
                raise rpc_error(grpc.StatusCode.UNAVAILABLE, "EMBEDDING_GONE: embedding lease-0 not found")
            return await real(request, timeout=timeout)

        stub = type("Stub", (), {})()
        stub.Prefill = call
        return stub

    h.stubs.prefill = prefill_for
    assert asyncio.run(h.tokens(image_request(1))) == [7, 8, 9]
    assert len(h.log) == 2 and len(tried) == 2  # re-encoded once; no member retry in between
    assert members.outstanding == dict.fromkeys(["p0:1", "p1:1"], 0)


def test_a_reasoned_draining_refusal_is_waited_out_whatever_its_details(monkeypatch: pytest.MonkeyPatch) -> None:
    _reasons_from_details(monkeypatch)
    h = Harness()
    calls = 0
    real = h.prefill.Prefill

    async def refusing(request: Any, timeout: float | None = None, **kw: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls <= 2:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "DRAINING: shutting down")  # no "draining" substring
        return await real(request, timeout=timeout)

    h.prefill.Prefill = refusing  # type: ignore[method-assign]
    assert asyncio.run(h.tokens(image_request(1))) == [7, 8, 9]
    assert calls == 3 and len(h.log) == 1  # waited out, not re-encoded (as a reason-less drain)
