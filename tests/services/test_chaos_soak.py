"""The chaos soak's short mode (the full run is `make soak`): a supervised E/P/D stack under load
while an encoder, the prefill, the decode, the router and the store master are killed in turn,
each after a window of completed requests on a settled stack, the next once it is back. Nothing
may be lost (wrong or missing answers), every killed role comes back, pools end empty."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.soak.soak import ROLES, SoakConfig, render, run_soak

pytestmark = pytest.mark.stack


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_short_chaos_soak_loses_nothing(model_path: Path, tmp_path: Path) -> None:
    faults = ROLES[:5]  # one kill each: encoder-0, prefill, decode, router, store master
    config = SoakConfig(
        model=model_path, run_dir=tmp_path / "stack", faults=faults, window_requests=20, time_limit_s=600, clients=4
    )
    result = run_soak(config, log=tmp_path / "soak.json")
    print(render(result))
    # The soak ended because every fault was made and recovered from, each after its window.
    assert not result.incomplete, render(result)
    assert [w["role"] for w in result.windows] == list(faults), result.windows
    assert all(w["requests"] >= config.window_requests and w["recovery_s"] is not None for w in result.windows)
    assert result.lost == 0, render(result)
    assert result.pools_empty, result.busy_pools
    assert result.completed > 0 and result.sent == result.completed + sum(result.failed.values()) + result.lost
    killed = {kill.split(":")[0] for kill in result.kills}
    assert killed == set(faults), result.kills
    assert all(result.restarts[role] >= 1 for role in faults), result.restarts
    # Only statuses a client can act on: a stage died mid-stream (UNAVAILABLE), or gave up on a
    # peer that was down (the router's own deadline/availability codes); never INTERNAL or UNKNOWN.
    assert set(result.failed) <= {"UNAVAILABLE", "CANCELLED", "NOT_FOUND", "DATA_LOSS", "ABORTED"}, result.failed
