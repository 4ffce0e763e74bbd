"""The TTFT attribution rule of `epd trace report` on synthetic spans whose answer is worked out by
hand: stage spans overlap (two media items encoded in parallel, a cache load inside both), a stage
runs past the first token, a grouping span carries no stage, a span lies outside the request."""

from __future__ import annotations

from typing import Any

import pytest

from libs.telemetry.report import CATEGORIES, RequestBreakdown, attribute, breakdowns, matching, render_text
from libs.telemetry.spans import SpanRecord

pytestmark = pytest.mark.unit

TRACE = "ab" * 16
MS = 1_000_000  # ns
T0 = 1_700_000_000_000 * MS  # an arbitrary epoch instant: spans carry wall-clock times


def span(name: str, stage: str | None, start_ms: float, end_ms: float, **attributes: Any) -> SpanRecord:
    if stage is not None:
        attributes["epd.stage"] = stage
    return SpanRecord(
        trace_id=attributes.pop("trace_id", TRACE),
        span_id=attributes.pop("span_id", f"{abs(hash((name, start_ms, end_ms))):016x}"[:16]),
        parent_id=attributes.pop("parent_id", "00" * 8),
        name=name,
        service=attributes.pop("service", "encoder"),
        start_ns=T0 + int(start_ms * MS),
        end_ns=T0 + int(end_ms * MS),
        attributes=attributes,
    )


# Milliseconds after the request's start; its first token comes at 22.
ITEM_A, ITEM_B = "a1" * 8, "b2" * 8  # the two items' Encode server spans: the branches
SPANS = [
    # Item A: queue 0-1, preprocess 1-3, encode 3-10, done at 11. Item B, in parallel: queue 0-2,
    # preprocess 2-4, encode 4-14, done at 15. The request waits for B: B's stages are the critical
    # path even where one of A's ends later (A's preprocess at 2-3 outlives B's queue).
    span("EncoderService/Encode", None, 0, 11, span_id=ITEM_A),
    span("encoder.queue", "queue", 0, 1, parent_id=ITEM_A),
    span("encoder.preprocess", "preprocess", 1, 3, parent_id=ITEM_A),
    span("encoder.compute", "encode", 3, 10, parent_id=ITEM_A),
    span("EncoderService/Encode", None, 0, 15, span_id=ITEM_B),
    span("encoder.queue", "queue", 0, 2, parent_id=ITEM_B),
    span("encoder.preprocess", "preprocess", 2, 4, parent_id=ITEM_B),
    span("encoder.compute", "encode", 4, 14, parent_id=ITEM_B),
    # A cache load on A's branch that starts last: hidden by B's encode, which the request waits for.
    span("cache.load", "cache_load", 5, 7, parent_id=ITEM_A),
    span("embeddings.transfer", "transfer", 14, 16, service="prefill"),
    span("prefill.compute", "prefill", 16, 20, service="prefill"),
    # 20-21: no stage span (an RPC hop): "other". Decode starts at 21 and runs past the first token.
    span("decode.generate", "decode", 21, 30, service="decode"),
    span("epd.encode", None, 0, 14, service="router"),  # a grouping span: never counted
    span("router.queue", "queue", -5, -1, service="router"),  # before the request's window
]
WANT_MS = {"queue": 2, "preprocess": 2, "encode": 10, "cache_load": 0, "transfer": 2, "prefill": 4, "decode": 1}


def _seconds(parts_ms: dict[str, float]) -> dict[str, float]:
    return {c: parts_ms.get(c, 0) / 1000 for c in CATEGORIES}


def test_each_instant_goes_to_the_stage_of_the_branch_that_ends_last() -> None:
    parts = attribute(SPANS, T0, T0 + 22 * MS)
    assert parts == pytest.approx(_seconds({**WANT_MS, "other": 1}), abs=1e-9)


def test_a_window_without_stage_spans_is_all_other() -> None:
    parts = attribute(SPANS, T0 + 30 * MS, T0 + 35 * MS)
    assert parts == pytest.approx(_seconds({"other": 5}), abs=1e-9)


def test_breakdowns_take_the_window_from_the_root_and_keep_traces_apart() -> None:
    root = span(
        "GenerateService/Generate",
        None,
        0,
        30,
        service="router",
        parent_id="",
        **{"epd.ttft_s": 0.022, "epd.request_id": "r-1", "gen_ai.usage.output_tokens": 9},
    )
    other_trace = [
        span("GenerateService/Generate", None, 100, 110, trace_id="cd" * 16, parent_id="", service="router"),
        span("prefill.compute", "prefill", 101, 109, trace_id="cd" * 16, service="prefill"),
    ]  # no epd.ttft_s: a request that never produced a token is not reported
    (item,) = breakdowns([*SPANS, root, *other_trace])
    assert (item.trace_id, item.request_id, item.output_tokens) == (TRACE, "r-1", 9)
    assert item.ttft_s == 0.022 and item.e2e_s == pytest.approx(0.030)
    assert item.services == ["decode", "encoder", "prefill", "router"]
    assert item.parts == pytest.approx(_seconds({**WANT_MS, "other": 1}), abs=1e-6)
    text = render_text([item])
    assert "r-1" in text and "p90 (1 requests)" in text


def test_a_request_through_the_openai_door_is_reported_from_the_routers_span() -> None:
    """The door's HTTP server span is the router span's parent, in the same file."""
    door = span("POST /v1/chat/completions", None, -2, 31, service="openai_door", parent_id="")
    root = span(
        "GenerateService/Generate",
        None,
        0,
        30,
        service="router",
        parent_id=door.span_id,
        **{"epd.ttft_s": 0.022, "epd.request_id": "r-door"},
    )
    (item,) = breakdowns([*SPANS, door, root])
    assert (item.request_id, item.ttft_s) == ("r-door", 0.022)
    assert "openai_door" in item.services


def test_time_outside_stages_goes_to_the_innermost_marked_span() -> None:
    """A router root marked "router", a call span marked "rpc" around the callee's server span
    marked "service", stages inside: hop, bookkeeping and router time each get their own column."""
    spans = [
        span("GenerateService/Generate", None, 0, 30, service="router", parent_id="", **{"epd.attribution": "router"}),
        span("epd.prefill", None, 2, 20, service="router", **{"epd.attribution": "rpc"}),  # call 2-20
        span("PrefillService/Prefill", None, 4, 17, service="prefill", **{"epd.attribution": "service"}),
        span("prefill.queue", "queue", 4.5, 5, service="prefill"),
        span("prefill.compute", "prefill", 6, 16, service="prefill"),
        span("epd.encode", None, 0, 2, service="router"),  # unmarked grouping span: the root's time
    ]
    parts = attribute(spans, T0, T0 + 22 * MS)
    # router: 0-2 and 20-22; rpc: 2-4 and 17-20; service: 4-4.5, 5-6, 16-17; stages as covered.
    want = {"router": 4, "rpc": 5, "service": 2.5, "queue": 0.5, "prefill": 10}
    assert parts == pytest.approx(_seconds(want), abs=1e-9)
    assert sum(parts.values()) == pytest.approx(0.022)
    unmarked = [
        span(s.name, s.attributes.get("epd.stage"), (s.start_ns - T0) / MS, (s.end_ns - T0) / MS) for s in spans
    ]
    assert attribute(unmarked, T0, T0 + 22 * MS)["other"] == pytest.approx(0.0115)  # without marks: other


def _request(request_id: str, trace_id: str) -> RequestBreakdown:
    return RequestBreakdown(trace_id, 0, request_id, ["router"], 0.01, 0.02, 4, dict.fromkeys(CATEGORIES, 0.0))


def test_a_request_is_found_by_the_ids_users_are_shown() -> None:
    """`epd generate` prints the request id, the OpenAI door answers `chatcmpl-<request id>` (its
    choices run as `<id>-0`, `<id>-1`), the report's rows show the whole request id; any of them,
    or the trace id, or the start of one of them, names the request."""
    cli = _request("c8dab82ab3b04443baad8cd916c467b7", "ab" * 16)
    door = _request("19c38c6ce16149308488858a81807589", "cd" * 16)
    choices = [_request(f"5f0e{'1' * 28}-{i}", f"{i}e" * 16) for i in (0, 1)]
    items = [cli, door, *choices]
    assert matching(items, "c8dab82ab3b04443baad8cd916c467b7") == [cli]
    assert matching(items, "[c8dab82ab3b04443baad8cd916c467b7]") == [cli]  # as printed, brackets and all
    assert matching(items, "chatcmpl-19c38c6ce16149308488858a81807589") == [door]
    assert matching(items, "cd" * 16) == [door]
    assert matching(items, "c8dab82a") == [cli]  # a prefix of 8 or more
    assert matching(items, "c8da") == []  # shorter: too loose to name one
    assert matching(items, f"chatcmpl-5f0e{'1' * 28}") == choices
    text = render_text(items)
    assert "c8dab82ab3b04443baad8cd916c467b7 " in text  # the whole id, not its first 20 characters


def test_each_row_says_what_a_cached_prefix_and_held_items_saved() -> None:
    """A conversation's later turn: its cached prompt tokens and the items no encoder saw, per row
    and in total (the root span's epd.usage.cached_input_tokens and epd.encode.held_items)."""

    def turn(trace: str, request: str, cached: int, held: int) -> SpanRecord:
        attributes = {
            "epd.ttft_s": 0.01,
            "epd.request_id": request,
            "gen_ai.usage.input_tokens": 400,
            "epd.usage.cached_input_tokens": cached,
        }
        if held:
            attributes["epd.encode.held_items"] = held
        return span(
            "GenerateService/Generate", None, 0, 20, service="router", parent_id="", trace_id=trace, **attributes
        )

    first, later = breakdowns([turn("01" * 16, "turn-1", 0, 0), turn("02" * 16, "turn-2", 320, 1)])
    assert (first.cached_tokens, first.held_items) == (0, 0)
    assert (later.prompt_tokens, later.cached_tokens, later.held_items) == (400, 320, 1)
    text = render_text([first, later])
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith("turn-")}
    assert rows["turn-1"][-2:] == ["0/400", "0"] and rows["turn-2"][-2:] == ["320/400", "1"]
    assert "prompt tokens from a cached prefix: 40%; media items held, not encoded: 1" in text
