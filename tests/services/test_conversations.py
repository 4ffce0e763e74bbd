"""A conversation that keeps its image across turns, sent as a chat client sends it (every turn
resends the whole conversation), through real reference-engine stacks: the next turn reuses the
prefix its earlier turn left in the prefill's prefix cache (`Usage.cached_prompt_tokens`), calls
no encoder (the image goes as held, contract 1.9) and answers with the same tokens as a prefill
from nothing; another tenant (`cache_salt`) sending the same conversation reuses none of it and
gets its image encoded; a member that evicted the prefix gets the image encoded on a retry; with
two PD members, each conversation's turns meet their prefix on one member, no encoder called."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from libs.launch.process import free_port
from libs.launch.stack import Stack, StackSpec
from libs.telemetry.spans import OtlpReceiver, SpanRecord
from tests.support.conversations import encoder_leases, turn
from tests.support.metrics import counter_total, sample_values, scrape
from tests.support.stacks import run_requests

pytestmark = [pytest.mark.stack, pytest.mark.timeout(300)]


@pytest.mark.parametrize("layout", ["e+pd", "e/p/d"])
def test_the_next_turn_reuses_its_tenants_prefix_only(
    layout: str, stacks: Callable[[str], Stack], receiver: OtlpReceiver
) -> None:
    stack = stacks(layout)
    tenant, other = f"tenant-{uuid.uuid4().hex}", f"tenant-{uuid.uuid4().hex}"  # scopes no other test used
    (first,) = run_requests(stack.address, [turn(tenant, None)])
    assert first.cached_prompt_tokens == 0
    encoded = encoder_leases(stack)
    next_turn = turn(tenant, first.text)
    next_turn.request_id = f"next-{uuid.uuid4().hex}"
    (again,) = run_requests(stack.address, [next_turn])
    assert encoder_leases(stack) == encoded, "the next turn was encoded though its member held its image"
    (stranger,) = run_requests(stack.address, [turn(other, first.text)])
    assert encoder_leases(stack) == encoded + 1, "another tenant's turn was not encoded"
    assert again.cached_prompt_tokens >= first.prompt_tokens // 2 > 0, "the second turn reused no image block"
    assert again.cached_prompt_tokens < again.prompt_tokens
    assert stranger.cached_prompt_tokens == 0, "another tenant's request reused this tenant's prefix"
    assert again.token_ids == stranger.token_ids, "tokens with reuse differ from a prefill from nothing"
    assert again.prompt_tokens == stranger.prompt_tokens
    # What `epd trace report` reads of it: the router's span says the image was held, not encoded.
    (root,) = _root_spans(receiver, next_turn.request_id)
    assert root.attributes["epd.encode.held_items"] == 1
    assert root.attributes["epd.usage.cached_input_tokens"] == again.cached_prompt_tokens


def _root_spans(receiver: OtlpReceiver, request_id: str, timeout_s: float = 30.0) -> list[SpanRecord]:
    """The router's Generate spans of one request, once exported (spans arrive in batches)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = [
            s
            for s in receiver.snapshot()
            if s.name == "GenerateService/Generate" and s.attributes.get("epd.request_id") == request_id
        ]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def test_with_two_pd_members_each_conversation_meets_its_prefix(model_path: Path, tmp_path: Path) -> None:
    """Several conversations over two PD members: the router sends every turn of a conversation to
    the member holding its prefix (services/router/affinity.py), so each second turn reuses it."""
    ports = {name: free_port() for name in ("router", "pd-0", "pd-1")}
    metrics = {name: ["--metrics-port", str(port)] for name, port in ports.items()}
    stack = Stack(StackSpec(layout="e+pd", encoders=1, pds=2, model=model_path, run_dir=tmp_path, extra_args=metrics))
    stack.up()
    try:
        # One conversation at a time: no member is ever busier than the bound lets affinity be
        # (tests/router/test_pools.py covers the bound), so every turn meets its conversation's member.
        reused, encoded = [], []
        for tenant in (f"tenant-{i}" for i in range(4)):
            (first,) = run_requests(stack.address, [turn(tenant, None)])
            before = encoder_leases(stack)
            (second,) = run_requests(stack.address, [turn(tenant, first.text)])
            reused.append(second.cached_prompt_tokens > 0)
            encoded.append(encoder_leases(stack) - before)
        assert reused == [True] * 4
        assert encoded == [0] * 4, "a second turn was encoded though its member held its image"
        # What /metrics says of it: four images sent as held, four reused whole, tokens cached.
        router, *pds = (scrape(ports[name]) for name in ("router", "pd-0", "pd-1"))
        assert counter_total(router, "epd_router_encodes_skipped_total") == 4
        assert sum(counter_total(pd, "epd_prefill_reused_items_total") for pd in pds) == 4
        cached = [v for pd in pds for v in sample_values(pd, "epd_prefill_prompt_tokens_total", 'epd_cached="true"')]
        assert sum(cached) > 0
    finally:
        statuses = stack.down()
    assert all(code == 0 for code in statuses.values()), statuses


def test_a_member_that_evicted_the_prefix_gets_the_image_encoded_again(model_path: Path, tmp_path: Path) -> None:
    """A prefix cache of one conversation's blocks (1 MiB here): another tenant's turn evicts the
    first tenant's prefix, whose next turn the router still sends as held; the PD member answers
    EMBEDDING_NEEDED and the router encodes the image and retries, with the answer of a prefill
    from nothing."""
    spec = StackSpec(
        layout="e+pd", encoders=1, model=model_path, run_dir=tmp_path, extra_args={"pd": ["--prefix-cache-mib", "1"]}
    )
    stack = Stack(spec)
    stack.up()
    try:
        (first,) = run_requests(stack.address, [turn("tenant-a", None)])
        run_requests(stack.address, [turn("tenant-b", None)])
        before = encoder_leases(stack)
        (again,) = run_requests(stack.address, [turn("tenant-a", first.text)])
        assert encoder_leases(stack) == before + 1, "the evicted image was not encoded again"
        assert again.cached_prompt_tokens == 0
        (cold,) = run_requests(stack.address, [turn("tenant-c", first.text)])
        assert again.token_ids == cold.token_ids
    finally:
        statuses = stack.down()
    assert all(code == 0 for code in statuses.values()), statuses
