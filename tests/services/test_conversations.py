"""A conversation that keeps its image across turns, sent as a chat client sends it (every turn
resends the whole conversation), through real reference-engine stacks: the next turn reuses the
prefix its earlier turn left in the prefill's prefix cache (`Usage.cached_prompt_tokens`) and
answers with the same tokens as a prefill from nothing; another tenant (`cache_salt`) sending the
same conversation reuses none of it; with two PD members, each conversation's turns meet their
prefix on one member."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from libs.launch.stack import Stack, StackSpec
from tests.support.conversations import turn
from tests.support.stacks import run_requests

pytestmark = [pytest.mark.stack, pytest.mark.timeout(300)]


@pytest.mark.parametrize("layout", ["e+pd", "e/p/d"])
def test_the_next_turn_reuses_its_tenants_prefix_only(layout: str, stacks: Callable[[str], Stack]) -> None:
    stack = stacks(layout)
    tenant, other = f"tenant-{uuid.uuid4().hex}", f"tenant-{uuid.uuid4().hex}"  # scopes no other test used
    (first,) = run_requests(stack.address, [turn(tenant, None)])
    assert first.cached_prompt_tokens == 0
    (again,) = run_requests(stack.address, [turn(tenant, first.text)])
    (stranger,) = run_requests(stack.address, [turn(other, first.text)])
    assert again.cached_prompt_tokens >= first.prompt_tokens // 2 > 0, "the second turn reused no image block"
    assert again.cached_prompt_tokens < again.prompt_tokens
    assert stranger.cached_prompt_tokens == 0, "another tenant's request reused this tenant's prefix"
    assert again.token_ids == stranger.token_ids, "tokens with reuse differ from a prefill from nothing"
    assert again.prompt_tokens == stranger.prompt_tokens


def test_with_two_pd_members_each_conversation_meets_its_prefix(model_path: Path, tmp_path: Path) -> None:
    """Several conversations over two PD members: the router sends every turn of a conversation to
    the member holding its prefix (services/router/affinity.py), so each second turn reuses it."""
    stack = Stack(StackSpec(layout="e+pd", encoders=1, pds=2, model=model_path, run_dir=tmp_path))
    stack.up()
    try:
        # One conversation at a time: no member is ever busier than the bound lets affinity be
        # (tests/router/test_pools.py covers the bound), so every turn meets its conversation's member.
        reused = []
        for tenant in (f"tenant-{i}" for i in range(4)):
            (first,) = run_requests(stack.address, [turn(tenant, None)])
            (second,) = run_requests(stack.address, [turn(tenant, first.text)])
            reused.append(second.cached_prompt_tokens > 0)
        assert reused == [True] * 4
    finally:
        statuses = stack.down()
    assert all(code == 0 for code in statuses.values()), statuses
