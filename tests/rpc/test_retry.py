"""Which failures a caller retries (libs/rpc/retry.py): by the reason a 1.5 peer sends; without one
(an older peer, grpc core's own statuses) by the code, and for UNAVAILABLE by the "draining"
substring, which a reasoned status never falls back to."""

from __future__ import annotations

import grpc
import pytest

from libs.contract.reasons import Reason
from libs.rpc.retry import CLIENT_RETRIES, DRAINING, GOING_AWAY, going_away, stopping, went_away
from tests.support.rpc_errors import rpc_error

pytestmark = pytest.mark.unit

UNAVAILABLE, CANCELLED = grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED


def test_every_reason_has_a_client_decision() -> None:
    assert set(CLIENT_RETRIES) == set(Reason)
    assert all(CLIENT_RETRIES[reason] for reason in GOING_AWAY)


def test_without_a_reason_the_code_and_the_draining_word_decide() -> None:
    assert stopping(UNAVAILABLE, f"prefill is {DRAINING} for shutdown; retry elsewhere or later")
    assert stopping(CANCELLED, None)
    assert not stopping(UNAVAILABLE, "producer 127.0.0.1:9 unreachable: UNAVAILABLE")
    assert not stopping(grpc.StatusCode.NOT_FOUND, "draining")


@pytest.mark.parametrize("reason", list(Reason))
def test_a_reason_decides_whatever_the_message_says(reason: Reason) -> None:
    going = reason in GOING_AWAY
    for details in ("stage is draining for shutdown", "the encoder went away"):
        assert stopping(UNAVAILABLE, details, reason) == going
        assert going_away(rpc_error(UNAVAILABLE, details, reason)) == going
    assert went_away(rpc_error(UNAVAILABLE, "x", reason)) == CLIENT_RETRIES[reason]


def test_what_a_client_retries_without_a_reason() -> None:
    assert went_away(rpc_error(UNAVAILABLE, "connection refused"))
    assert went_away(rpc_error(CANCELLED, "CANCELLED"))
    assert not went_away(rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "router is full"))
    assert not went_away(rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_k: negative"))
    # An overloaded router's reasoned refusal is not retried, like its reason-less one before.
    assert not went_away(rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "router is full", Reason.OVERLOADED))
