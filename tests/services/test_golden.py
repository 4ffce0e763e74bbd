"""Golden equivalence: for every layout and modality mix, the tokens streamed by the front service
(router, or the colocated service) equal the colocated model's own generate(), greedy, token for
token, with every service in its own process."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from libs.launch.stack import Stack
from tests.services.conftest import MIXES, run_requests
from tests.services.golden import request_for

LAYOUTS = ["colocated", "e+pd", "e/p/d"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_mix_matches_generate(
    layout: str, stacks: Callable[[str], Stack], expected: dict[str, list[int]]
) -> None:
    stack = stacks(layout)
    names = sorted(MIXES)
    results = run_requests(stack.address, [request_for(MIXES[n], request_id=f"golden-{n}") for n in names])
    got = {name: result.token_ids for name, result in zip(names, results, strict=True)}
    assert got == {name: expected[name] for name in names}
    for name, result in zip(names, results, strict=True):
        assert result.request_id == f"golden-{name}"
        assert result.completion_tokens == len(result.token_ids) > 0
        assert result.finish_reason in {"FINISH_REASON_LENGTH", "FINISH_REASON_STOP"}
