"""Golden equivalence: for every layout and modality mix, the tokens streamed by the front service
(router, or the colocated service) equal the colocated model's own generate(), greedy, token for
token, with every service in its own process, and the finish reason is the one those tokens imply."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from libs.launch.stack import Stack
from tests.support.golden import MAX_TOKENS, request_for
from tests.support.stacks import MIXES, run_requests

pytestmark = pytest.mark.stack

LAYOUTS = ["colocated", "e+pd", "e/p/d"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_mix_matches_generate(
    layout: str, stacks: Callable[[str], Stack], expected: dict[str, list[int]], model_path: Path
) -> None:
    stack = stacks(layout)
    names = sorted(MIXES)
    results = run_requests(stack.address, [request_for(MIXES[n], request_id=f"golden-{n}") for n in names])
    got = {name: result.token_ids for name, result in zip(names, results, strict=True)}
    assert got == {name: expected[name] for name in names}
    for name, result in zip(names, results, strict=True):
        assert result.request_id == f"golden-{name}"
        assert result.completion_tokens == len(result.token_ids) > 0
        assert result.finish_reason == _finish_reason(expected[name], _eos_ids(model_path)), name


def _eos_ids(model_path: Path) -> set[int]:
    """The checkpoint's end-of-sequence ids, as generate() reads them (generation_config.json)."""
    raw = json.loads((model_path / "generation_config.json").read_text())["eos_token_id"]
    return set(raw) if isinstance(raw, list) else {raw}


def _finish_reason(tokens: list[int], eos: set[int]) -> str:
    """generate() stops after an end-of-sequence token (and keeps it), else at max_new_tokens."""
    if tokens and tokens[-1] in eos:
        return "FINISH_REASON_STOP"
    assert len(tokens) == MAX_TOKENS, tokens
    return "FINISH_REASON_LENGTH"
