"""E/P/D with two encoders under 64 concurrent mixed requests: none lost, every one equal to the
model's own generate(), and every pool back to empty afterwards."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from libs.launch.stack import Stack
from tests.support.golden import request_for
from tests.support.stacks import MIXES, run_requests, wait_pools_empty

pytestmark = pytest.mark.stack


@pytest.mark.timeout(600)
def test_64_mixed_requests_in_flight(stacks: Callable[[str], Stack], expected: dict[str, list[int]]) -> None:
    stack = stacks("e/p/d")
    names = sorted(MIXES)
    plan = [names[i % len(names)] for i in range(64)]
    requests = [request_for(MIXES[name], request_id=f"load-{i}") for i, name in enumerate(plan)]
    results = run_requests(stack.address, requests, timeout_s=300)
    assert len(results) == 64
    assert [r.request_id for r in results] == [f"load-{i}" for i in range(64)]
    wrong = {i: (plan[i], r.token_ids) for i, r in enumerate(results) if r.token_ids != expected[plan[i]]}
    assert not wrong
    stats = wait_pools_empty(stack)
    encoders = [s for name, s in stats.items() if name.startswith("encoder-")]
    # Both encoders took work (least outstanding work spreads it) and every lease was acked.
    assert all(s.pool.acked_leases > 0 for s in encoders)
    assert sum(s.pool.acked_leases for s in encoders) >= sum(len(MIXES[n].media) for n in plan)
    # Every request that went on past its first token had its KV read and acked by decode.
    assert stats["prefill"].pool.acked_leases >= sum(1 for r in results if len(r.token_ids) > 1)
