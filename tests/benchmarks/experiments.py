"""The seed's experiments on the ~100M "small" checkpoint, as ratios against baselines measured in
the same run (a benchmark script, not a test; pytest does not collect it). docs/results/experiments.md
explains each one and what its ratio means.

    .venv/bin/python tests/benchmarks/experiments.py all          # make bench-all: every experiment, one table
    .venv/bin/python tests/benchmarks/experiments.py p3 p8        # make bench-tax (P8 shares P3's stacks)
    .venv/bin/python tests/benchmarks/experiments.py p7           # make bench-split
    .venv/bin/python tests/benchmarks/experiments.py p7v          # make bench-split-vllm
    .venv/bin/python tests/benchmarks/experiments.py p4           # make bench-metadata
    .venv/bin/python tests/benchmarks/experiments.py p5           # make bench-reassign

P3 tax: one request at a time, interleaved across colocated, E+PD and E/P/D stacks; TTFT over
(encode + prefill compute of the same request, from its spans) and over colocated TTFT.
P8 router overhead: TTFT through the router vs the same metadata-only request sent to prefill
directly (and the encoder directly, for images); p50 and p99, interleaved.
P7 split vs colocated: closed-loop concurrency sweep of a text + image mix (and 4 images per
request) with the cores split between encoder and PD/P+D against a colocated process on all of
them; text-only p90 TTFT and goodput. P7v: the same question on vLLM (E+PD), prompts chunked as the
services' --prefill-chunk-tokens vs whole.
P4 metadata-only: image and audio throughput with prefill given metadata only vs the baseline mode
that forwards the raw media too (prefill decodes and preprocesses it, as a non-metadata path).
P5 reassignment: tests/benchmarks/bench_cache.py's experiment in this harness.
Results: var/experiments/<experiment>.json and .png and the table summary.md (--out); the run of
record is on docs/results/experiments.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as h

from libs.bench.load import LoadConfig, grpc_sender, run_load
from libs.bench.mix import MixSpec, PlannedRequest, plan_requests
from libs.bench.results import bar_plot, line_plot, write_json
from libs.bench.stats import RequestRecord, Slo, report, summarize
from libs.client.generate import open_channel
from libs.telemetry.report import breakdowns
from libs.telemetry.spans import SpanRecord, by_trace
from libs.telemetry.tracing import configure_tracing

OUT = h.ROOT / "var" / "experiments"
COMPUTE_SPANS = ("encoder.preprocess", "encoder.compute", "prefill.compute")
ROWS: list[dict[str, str]] = []  # the summary table, one row per measured ratio


def row(experiment: str, metric: str, ratio: float, ours: str, seed: str, goal: str = "") -> None:
    ROWS.append(
        {
            "experiment": experiment,
            "metric": metric,
            "ratio": f"{ratio:.3f}",
            "absolute": ours,
            "seed": seed,
            "goal": goal,
        }
    )
    print(f"  {experiment:<4} {metric:<58} {ratio:7.3f}   {ours}", flush=True)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds >= 0.1 else f"{seconds * 1e3:.1f} ms"


# --- clients ------------------------------------------------------------------------------------


async def _one(send: Any, planned: PlannedRequest) -> RequestRecord:
    record = RequestRecord(planned.kind, 0.0, request_id=planned.request.request_id)
    try:
        await send(planned, record)
    except Exception as exc:
        record.error = str(exc)[:200]
    return record


async def _p3_rounds(
    stacks: Sequence[h.BenchStack], plans: dict[str, list[PlannedRequest]], rounds: int
) -> dict[str, list[RequestRecord]]:
    """One request at a time, each stack over one channel held for the whole run (as a serving
    client holds it: a channel per request would put its TCP and HTTP/2 set-up into every TTFT)."""
    records: dict[str, list[RequestRecord]] = {s.name: [] for s in stacks}
    async with contextlib.AsyncExitStack() as exits:
        senders = {s.name: grpc_sender(await exits.enter_async_context(open_channel(s.address))) for s in stacks}
        for s in stacks:  # first contact, the connection and warm caches out of the figures
            for kind in plans:
                await _one(senders[s.name], plans[kind].pop())
        for r in range(rounds):
            order = [*stacks[r % 3 :], *stacks[: r % 3]]  # rotate who goes first
            for kind in plans:
                for s in order:
                    records[s.name].append(await _one(senders[s.name], plans[kind].pop()))
    return records


def compute_by_trace(spans: list[SpanRecord]) -> dict[str, dict[str, float]]:
    """trace id -> seconds in each compute span name (summed; items in parallel are summed too)."""
    out: dict[str, dict[str, float]] = {}
    for trace_id, trace_spans in by_trace(spans).items():
        parts = dict.fromkeys(COMPUTE_SPANS, 0.0)
        for span in trace_spans:
            if span.name in parts:
                parts[span.name] += span.duration_s
        out[trace_id] = parts
    return out


# --- P3 + P8 ------------------------------------------------------------------------------------


def p3_p8(model: Path, run_dir: Path, rounds: int, p8_requests: int) -> dict[str, Any]:
    print(f"P3 tax / P8 router overhead: {rounds} rounds, shared cores {h.ALL}, 1 torch thread per process")
    stacks = [
        h.make_stack(name, layout, model, run_dir, cpus="shared", threads=1)
        for name, layout in (("colocated", "colocated"), ("e+pd", "e+pd"), ("e/p/d", "e/p/d"))
    ]
    kinds = {"text": MixSpec(text=1, max_tokens=2), "image": MixSpec(image=1, images=1, max_tokens=2)}
    plans = {k: plan_requests(spec, rounds * len(stacks) + 4, seed=30 + i) for i, (k, spec) in enumerate(kinds.items())}
    with h.running(*stacks):
        load_before = h.load_average()
        records = asyncio.run(_p3_rounds(stacks, plans, rounds))
        p8 = _p8(stacks[2], p8_requests)
        load_after = h.load_average()
        time.sleep(1.0)
    _router_own_time(p8, stacks[2].spans())
    result: dict[str, Any] = {"load": [load_before, load_after], "rounds": rounds, "layouts": {}}
    colocated = {k: h.median([r.ttft_s for r in records["colocated"] if r.kind == k and r.ok]) for k in kinds}
    for s in stacks:
        compute = compute_by_trace(s.spans())
        per_kind: dict[str, Any] = {}
        for kind in kinds:
            rs = [r for r in records[s.name] if r.kind == kind and r.ok]
            ratios = [
                r.ttft_s / sum(compute[r.trace_id].values())
                for r in rs
                if sum(compute.get(r.trace_id, {}).values()) > 0
            ]
            comp = [sum(compute[r.trace_id].values()) for r in rs if r.trace_id in compute]
            per_kind[kind] = {
                "ttft_p50_s": h.median([r.ttft_s for r in rs]),
                "compute_p50_s": h.median(comp),
                "ttft_over_compute_p50": h.median(ratios),
                "ttft_over_colocated": h.median([r.ttft_s for r in rs]) / colocated[kind],
                "n": len(rs),
            }
        result["layouts"][s.name] = per_kind
    for name in ("e/p/d", "e+pd"):
        for kind in kinds:
            k = result["layouts"][name][kind]
            row(
                "P3",
                f"{name} {kind}: TTFT / (encode + prefill compute)",
                k["ttft_over_compute_p50"],
                f"TTFT {ms(k['ttft_p50_s'])}, compute {ms(k['compute_p50_s'])}",
                "1.05 (seed, image, E/P/D)" if name == "e/p/d" and kind == "image" else "",
                "<= 1.03" if name == "e/p/d" else "",
            )
            row(
                "P3",
                f"{name} {kind}: TTFT / colocated TTFT",
                k["ttft_over_colocated"],
                f"{ms(k['ttft_p50_s'])} vs {ms(colocated[kind])}",
                "1.06 (seed, image, E/P/D)" if name == "e/p/d" and kind == "image" else "",
            )
    for kind in kinds:
        k = result["layouts"]["colocated"][kind]
        row(
            "P3",
            f"colocated {kind}: TTFT / (encode + prefill compute)",
            k["ttft_over_compute_p50"],
            f"TTFT {ms(k['ttft_p50_s'])}, compute {ms(k['compute_p50_s'])}",
            "",
        )
    result["p8"] = p8
    for kind, v in p8.items():
        for q in ("p50", "p99"):
            row(
                "P8",
                f"router overhead {kind} {q}: router TTFT - direct",
                v[f"router_{q}_s"] / v[f"direct_{q}_s"],
                f"{ms(v[f'router_{q}_s'] - v[f'direct_{q}_s'])} ({ms(v[f'router_{q}_s'])} vs {ms(v[f'direct_{q}_s'])})",
                "",
                "<= 1 ms p50" if q == "p50" else "",
            )
        row(
            "P8",
            f"router's own time {kind} p50 (its spans) / router TTFT",
            v["router_own_p50_s"] / v["router_p50_s"],
            f"{ms(v['router_own_p50_s'])} own, {ms(v['rpc_p50_s'])} rpc hops",
            "",
            "<= 1 ms p50",
        )
    write_json(OUT / "p3_tax.json", {k: v for k, v in result.items() if k != "p8"})
    write_json(OUT / "p8_router.json", {"load": result["load"], **p8})
    bar_plot(
        OUT / "p3_tax.png",
        {
            f"{n}\n{k}": {
                "TTFT": result["layouts"][n][k]["ttft_p50_s"] * 1e3,
                "encode+prefill compute": result["layouts"][n][k]["compute_p50_s"] * 1e3,
            }
            for n in result["layouts"]
            for k in kinds
        },
        title="P3: TTFT vs compute, one request at a time (p50)",
        ylabel="ms",
    )
    bar_plot(
        OUT / "p8_router.png",
        {
            kind: {
                "router p50": v["router_p50_s"] * 1e3,
                "direct p50": v["direct_p50_s"] * 1e3,
                "router p99": v["router_p99_s"] * 1e3,
                "direct p99": v["direct_p99_s"] * 1e3,
            }
            for kind, v in p8.items()
        },
        title="P8: through the router vs straight to encoder/prefill",
        ylabel="ms",
    )
    return result


def _p8(s: h.BenchStack, n: int) -> dict[str, dict[str, Any]]:
    """Router TTFT vs direct Encode + Prefill of the same metadata-only request, interleaved."""
    from libs.contract.epd.v1 import encoder_pb2, encoder_pb2_grpc, prefill_pb2, prefill_pb2_grpc, tensor_pb2
    from libs.rpc.server import open_channel as peer_channel

    print(f"P8: {n} text and {n // 2} image requests each way")
    plans = {
        "text": plan_requests(MixSpec(text=1, max_tokens=1), 2 * n, seed=80),
        "image": plan_requests(MixSpec(image=1, images=1, max_tokens=1), n, seed=81, first_seed=5000),
    }

    routed: dict[str, list[str]] = {}  # kind -> request ids sent through the router

    async def run() -> dict[str, dict[str, list[float]]]:
        times: dict[str, dict[str, list[float]]] = {k: {"router": [], "direct": []} for k in plans}
        routed.update({k: [] for k in plans})
        async with (
            open_channel(s.address) as router,
            peer_channel(s.process_address("prefill")) as prefill_channel,
            peer_channel(s.process_address("encoder-0")) as encoder_channel,
        ):
            send = grpc_sender(router)
            prefill = prefill_pb2_grpc.PrefillServiceStub(prefill_channel)
            encoder = encoder_pb2_grpc.EncoderServiceStub(encoder_channel)
            for kind, plan in plans.items():
                for i, planned in enumerate(plan):
                    if i % 2 == 0:
                        record = RequestRecord(kind, 0.0)
                        await send(planned, record)
                        times[kind]["router"].append(record.ttft_s)
                        routed[kind].append(planned.request.request_id)
                        continue
                    started = time.perf_counter()
                    messages = list(planned.request.messages)
                    for message in messages:
                        for part in message.parts:
                            if part.HasField("media"):
                                reply = await encoder.Encode(
                                    encoder_pb2.EncodeRequest(
                                        request_id=f"p8-{i}",
                                        items=[encoder_pb2.EncodeItem(item_index=0, media=part.media)],
                                        accepted_transports=[tensor_pb2.TRANSPORT_KIND_NIXL],
                                    )
                                )
                                part.encoded.CopyFrom(reply.items[0])
                    await prefill.Prefill(
                        prefill_pb2.PrefillRequest(
                            request_id=f"p8-{i}",
                            messages=messages,
                            sampling=planned.request.sampling,
                            accepted_kv_transports=[tensor_pb2.TRANSPORT_KIND_NIXL],
                        )
                    )
                    times[kind]["direct"].append(time.perf_counter() - started)
        return times

    times = asyncio.run(run())
    out: dict[str, dict[str, Any]] = {}
    for kind, t in times.items():
        out[kind] = {
            "router_p50_s": h.pct(t["router"], 50),
            "router_p99_s": h.pct(t["router"], 99),
            "direct_p50_s": h.pct(t["direct"], 50),
            "direct_p99_s": h.pct(t["direct"], 99),
            "n": len(t["router"]),
            "router_s": t["router"],
            "direct_s": t["direct"],
            "routed_ids": routed[kind],
        }
    return out


def _router_own_time(p8: dict[str, dict[str, Any]], spans: list[SpanRecord]) -> None:
    """The router's own share of each routed P8 request's TTFT (`epd trace report`'s router and rpc
    columns): what the router adds, read from its spans rather than as a difference of two noisy
    TTFTs. Read once the stack stopped: its spans are then all in the trace file."""
    own = {b.request_id: b.parts for b in breakdowns(spans)}
    for v in p8.values():
        ids = [r for r in v.pop("routed_ids") if r in own]
        v["router_own_p50_s"] = h.pct([own[r]["router"] for r in ids], 50)
        v["rpc_p50_s"] = h.pct([own[r]["rpc"] for r in ids], 50)


# --- P7 -----------------------------------------------------------------------------------------


def _load_point(s: h.BenchStack, spec: MixSpec, clients: int, duration_s: float, seed: int) -> list[RequestRecord]:
    plan = plan_requests(spec, 2 + 400, seed=seed, first_seed=10_000 * (seed + 1))
    config = LoadConfig(mode="closed", concurrency=clients, duration_s=duration_s, max_requests=400, warmup_requests=2)

    async def run() -> list[RequestRecord]:
        async with open_channel(s.address) as channel:
            return await run_load(grpc_sender(channel), plan, config)

    return asyncio.run(run())


def _mix_point(
    s: h.BenchStack, label: str, spec: MixSpec, clients: int, duration_s: float, slo: Slo, seed: int
) -> dict[str, Any]:
    """One closed-loop point of a text + image mix: p90 TTFT per kind, image goodput, every record."""
    # A 4-image request does ~3x the work of a 1-image one: its TTFT limit grows with it, and its
    # point runs longer (such requests are few).
    point_slo = Slo(slo.ttft_s * (1 + 0.75 * (spec.images - 1)), slo.itl_s)
    seconds = duration_s * (1.5 if spec.images > 1 else 1.0)
    rep = report(_load_point(s, spec, clients, seconds, seed), point_slo)
    text, image = rep["by_kind"].get("text", {}), rep["by_kind"].get("image", {})
    point = {
        "mix": label,
        "clients": clients,
        "text_ttft_p90_s": text.get("ttft", {}).get("p90_s", float("nan")),
        "image_ttft_p90_s": image.get("ttft", {}).get("p90_s", float("nan")),
        "image_goodput_rps": image.get("goodput_rps", 0.0),
        "goodput_rps": rep["overall"]["goodput_rps"],
        "throughput_rps": rep["overall"]["throughput_rps"],
        "errors": rep["overall"]["errors"],
        "load": h.load_average(),
        "records": rep["records"],
    }
    print(
        f"  {label:<9} c={clients} {s.name:<14} text p90 {ms(point['text_ttft_p90_s'])}, "
        f"image p90 {ms(point['image_ttft_p90_s'])}, image goodput {point['image_goodput_rps']:.3f}/s, "
        f"errors {point['errors']}",
        flush=True,
    )
    return point


def p7(model: Path, run_dir: Path, duration_s: float, slo: Slo) -> dict[str, Any]:
    print(
        f"P7 split vs colocated: {duration_s:.0f} s per point, "
        f"cores split E {h.HALF_E} / LM {h.HALF_LM} vs colocated {h.ALL}"
    )
    stacks = [
        h.make_stack("p7-colocated", "colocated", model, run_dir, cpus="split"),
        h.make_stack("p7-e+pd", "e+pd", model, run_dir, cpus="split"),
        h.make_stack("p7-e/p/d", "e/p/d", model, run_dir, cpus="split"),
    ]
    points = [("1 image", MixSpec(text=0.5, image=0.5, images=1, max_tokens=8), clients) for clients in (2, 4, 8)] + [
        ("4 images", MixSpec(text=0.4, image=0.6, images=4, max_tokens=8), 5)
    ]
    result: dict[str, Any] = {"slo": asdict(slo), "points": []}
    with h.running(*stacks):
        result["load_start"] = h.load_average()
        for i, (label, spec, clients) in enumerate(points):
            for s in stacks[i % 3 :] + stacks[: i % 3]:
                point = _mix_point(s, label, spec, clients, duration_s, slo, seed=70 + i)
                result["points"].append({"layout": s.name.removeprefix("p7-"), **point})
        result["load_end"] = h.load_average()
    by = {(p["mix"], p["clients"], p["layout"]): p for p in result["points"]}
    for label, _, clients in points:
        base = by[(label, clients, "colocated")]
        for layout in ("e+pd", "e/p/d"):
            p = by[(label, clients, layout)]
            row(
                "P7",
                f"{layout} {label} c={clients}: text-only p90 TTFT / colocated",
                p["text_ttft_p90_s"] / base["text_ttft_p90_s"],
                f"{ms(p['text_ttft_p90_s'])} vs {ms(base['text_ttft_p90_s'])}",
                "0.53-0.56 (seed p90 TTFT, c=64-128)" if label == "1 image" else "",
                "<= 0.5",
            )
            row(
                "P7",
                f"{layout} {label} c={clients}: image goodput / colocated",
                _ratio(p["image_goodput_rps"], base["image_goodput_rps"]),
                f"{p['image_goodput_rps']:.3f} vs {base['image_goodput_rps']:.3f} req/s",
                "2.0 (seed, 4 images: 6 -> 12 req/s)" if label == "4 images" else "",
                ">= 1.5",
            )
    write_json(OUT / "p7_split.json", result)
    sweep = [p for p in result["points"] if p["mix"] == "1 image"]
    series = {
        layout: (
            [p["clients"] for p in sweep if p["layout"] == layout],
            [p["text_ttft_p90_s"] * 1e3 for p in sweep if p["layout"] == layout],
        )
        for layout in ("colocated", "e+pd", "e/p/d")
    }
    line_plot(
        OUT / "p7_text_ttft.png",
        series,
        title="P7: text-only p90 TTFT, text + 1-image mix",
        xlabel="closed-loop clients",
        ylabel="ms",
    )
    series = {
        layout: (
            [p["clients"] for p in sweep if p["layout"] == layout],
            [p["image_goodput_rps"] for p in sweep if p["layout"] == layout],
        )
        for layout in ("colocated", "e+pd", "e/p/d")
    }
    line_plot(
        OUT / "p7_goodput.png",
        series,
        title=f"P7: image goodput (TTFT <= {slo.ttft_s:g} s, ITL <= {slo.itl_s:g} s)",
        xlabel="closed-loop clients",
        ylabel="requests/s",
    )
    return result


WHOLE_PROMPTS = {"pd": ["--prefill-chunk-tokens", "4096"]}  # vLLM's cap past any prompt here: off


def p7_vllm(model: Path, run_dir: Path, duration_s: float, slo: Slo) -> dict[str, Any]:
    """P7's text-behind-multimodal question on vLLM: E+PD with PD on vLLM, cores split as in P7, with
    the services' prefill chunk (64 tokens: vLLM's long_prefill_token_threshold) against the same
    stack with whole prompts per step (a cap of 4096 tokens, longer than any prompt here)."""
    print(f"P7 on vLLM: E+PD, chunked prompts vs whole, {duration_s:.0f} s per point, split cores")
    stacks = [
        h.make_stack("p7v-chunked", "e+pd", model, run_dir, cpus="split", engine="vllm"),
        h.make_stack("p7v-whole", "e+pd", model, run_dir, cpus="split", engine="vllm", extra_args=WHOLE_PROMPTS),
    ]
    points = [
        ("1 image", MixSpec(text=0.5, image=0.5, images=1, max_tokens=8), 4),
        ("4 images", MixSpec(text=0.4, image=0.6, images=4, max_tokens=8), 5),
    ]
    result: dict[str, Any] = {"slo": asdict(slo), "points": []}
    with h.running(*stacks):
        result["load_start"] = h.load_average()
        for i, (label, spec, clients) in enumerate(points):
            for s in stacks[i % 2 :] + stacks[: i % 2]:
                point = _mix_point(s, label, spec, clients, duration_s, slo, seed=90 + i)
                result["points"].append({"prompts": s.name.removeprefix("p7v-"), **point})
        result["load_end"] = h.load_average()
    by = {(p["mix"], p["prompts"]): p for p in result["points"]}
    for label, _, clients in points:
        chunked, whole = by[(label, "chunked")], by[(label, "whole")]
        for key, what in (("text_ttft_p90_s", "text-only p90 TTFT"), ("image_ttft_p90_s", "image p90 TTFT")):
            row(
                "P7v",
                f"vllm e+pd {label} c={clients}: {what}, chunked / whole",
                chunked[key] / whole[key],
                f"{ms(chunked[key])} vs {ms(whole[key])}",
                "",
            )
        row(
            "P7v",
            f"vllm e+pd {label} c={clients}: image goodput, chunked / whole",
            _ratio(chunked["image_goodput_rps"], whole["image_goodput_rps"]),
            f"{chunked['image_goodput_rps']:.3f} vs {whole['image_goodput_rps']:.3f} req/s",
            "",
        )
    write_json(OUT / "p7_vllm.json", result)
    bar_plot(
        OUT / "p7_vllm.png",
        {
            f"{label} c={clients}": {
                f"{kind} p90, {prompts}": by[(label, prompts)][f"{kind}_ttft_p90_s"] * 1e3
                for kind in ("text", "image")
                for prompts in ("whole", "chunked")
            }
            for label, _, clients in points
        },
        title="P7 on vLLM (E+PD): p90 TTFT, prompts chunked (64 tokens) vs whole",
        ylabel="ms",
    )
    return result


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("inf") if a > 0 else float("nan")


# --- planner check --------------------------------------------------------------------------------


def plan_check(p7_result: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """`epd plan`'s model against P7's E+PD points: service times from each point's own spans,
    the same closed loop simulated, predicted p90 TTFT vs measured (goal: within 20 %)."""
    from libs.plan.profile import profile
    from libs.plan.simulate import Layout, Workload, simulate
    from libs.telemetry.spans import load_jsonl

    spans = load_jsonl(run_dir / "p7-e+pd" / "spans.jsonl")
    out: dict[str, Any] = {"points": []}
    for point in p7_result["points"]:
        if point["layout"] != "e+pd":
            continue
        ids = {r["trace_id"] for r in point["records"]}
        measured = profile([s for s in spans if s.trace_id in ids])
        ttfts = [r["ttft_s"] for r in point["records"] if not r["error"] and r["ttft_s"] is not None]
        spec = (
            MixSpec(text=0.5, image=0.5, images=1)
            if point["mix"] == "1 image"
            else MixSpec(text=0.4, image=0.6, images=4)
        )
        workload = Workload(spec.shares(), clients=point["clients"], duration_s=900, images=spec.images)
        predicted = simulate(measured, Layout("e+pd", 1, 1), workload)
        entry = {
            "mix": point["mix"],
            "clients": point["clients"],
            "requests": len(measured.requests),
            "measured_p90_s": h.pct(ttfts, 90),
            "predicted_p90_s": predicted.p90(),
            "measured_text_p90_s": point["text_ttft_p90_s"],
            "predicted_text_p90_s": predicted.p90("text"),
        }
        out["points"].append(entry)
        row(
            "PLAN",
            f"e+pd {point['mix']} c={point['clients']}: predicted / measured p90 TTFT",
            entry["predicted_p90_s"] / entry["measured_p90_s"],
            f"{ms(entry['predicted_p90_s'])} vs {ms(entry['measured_p90_s'])}",
            "",
            "within 0.8-1.2",
        )
    write_json(OUT / "plan_check.json", out)
    pts = out["points"]
    line_plot(
        OUT / "plan_check.png",
        {
            "measured": ([p["clients"] for p in pts], [p["measured_p90_s"] * 1e3 for p in pts]),
            "predicted (SimPy)": ([p["clients"] for p in pts], [p["predicted_p90_s"] * 1e3 for p in pts]),
        },
        title="epd plan: p90 TTFT, E+PD (P7 points)",
        xlabel="closed-loop clients",
        ylabel="ms",
    )
    return out


# --- P4 -----------------------------------------------------------------------------------------


def p4(model: Path, run_dir: Path, duration_s: float, clients: int) -> dict[str, Any]:
    print(f"P4 metadata-only vs raw media forwarded to prefill: {clients} clients, {duration_s:.0f} s per point")
    # The baseline's router and prefill run through the bench-only wrapper (tests/benchmarks/raw_media.py).
    forward = {side: ["tests.benchmarks.raw_media", f"--{side}"] for side in ("router", "prefill")}
    stacks = [
        h.make_stack("p4-metadata", "e/p/d", model, run_dir, cpus="split"),
        h.make_stack("p4-raw-media", "e/p/d", model, run_dir, cpus="split", run_through=forward),
    ]
    mixes = {"image": MixSpec(image=1, images=1, max_tokens=4), "audio": MixSpec(audio=1, max_tokens=4)}
    result: dict[str, Any] = {"points": []}
    with h.running(*stacks):
        result["load_start"] = h.load_average()
        for i, (kind, spec) in enumerate(mixes.items()):
            for s in stacks if i % 2 == 0 else stacks[::-1]:
                records = _load_point(s, spec, clients, duration_s, seed=40 + i)
                summary = summarize(records, Slo())
                result["points"].append(
                    {
                        "kind": kind,
                        "mode": s.name.removeprefix("p4-"),
                        "throughput_rps": summary["throughput_rps"],
                        "ttft": summary["ttft"],
                        "errors": summary["errors"],
                        "load": h.load_average(),
                    }
                )
                print(
                    f"  {kind:<6} {s.name:<16} {summary['throughput_rps']:.3f} req/s, "
                    f"TTFT p50 {ms(summary['ttft']['p50_s'])}, errors {summary['errors']}",
                    flush=True,
                )
    by = {(p["kind"], p["mode"]): p for p in result["points"]}
    for kind in mixes:
        meta, raw = by[(kind, "metadata")], by[(kind, "raw-media")]
        row(
            "P4",
            f"{kind}: throughput metadata-only / raw media forwarded",
            _ratio(meta["throughput_rps"], raw["throughput_rps"]),
            f"{meta['throughput_rps']:.3f} vs {raw['throughput_rps']:.3f} req/s",
            "1.18 (seed, audio: 62.21 -> 73.13 req/s)" if kind == "audio" else "",
        )
    write_json(OUT / "p4_metadata.json", result)
    bar_plot(
        OUT / "p4_metadata.png",
        {k: {m: by[(k, m)]["throughput_rps"] for m in ("metadata", "raw-media")} for k in mixes},
        title=f"P4: throughput, {clients} closed-loop clients",
        ylabel="requests/s",
    )
    return result


# --- P5 -----------------------------------------------------------------------------------------


def p5(model: Path, run_dir: Path, requests: int, images: int) -> dict[str, Any]:
    import bench_cache

    from libs.launch.store import start_store

    print(f"P5 reassignment: {requests} requests x {images} images")
    plan = bench_cache._requests(requests, images)
    store = start_store(run_dir / "p5-store", segment_size=512 << 20)
    try:
        a, _ = bench_cache._phase("A (fills the store)", model, run_dir / "p5", store.master_address, plan)
        before, p90_before = bench_cache._phase("B before (no shared store)", model, run_dir / "p5", "", plan)
        after, p90_after = bench_cache._phase(
            "B after (store filled by A)", model, run_dir / "p5", store.master_address, plan
        )
    finally:
        store.stop()
    result = {
        "encodes": {"A": a, "B_before": before, "B_after": after},
        "p90_ttft_s": {"before": p90_before, "after": p90_after},
        "load": h.load_average(),
    }
    row(
        "P5",
        "reassigned encoder: p90 TTFT with store / without",
        p90_after / p90_before,
        f"{ms(p90_after)} vs {ms(p90_before)}; encodes {before} -> {after}",
        "0.54 (seed: 1.656 -> 0.891 s)",
    )
    write_json(OUT / "p5_reassign.json", result)
    bar_plot(
        OUT / "p5_reassign.png",
        {"p90 TTFT": {"before (no store)": p90_before * 1e3, "after (store)": p90_after * 1e3}},
        title="P5: reassigned encoder",
        ylabel="ms",
    )
    return result


# --- table --------------------------------------------------------------------------------------


def write_table(started: float) -> str:
    lines = [
        f"EPD experiments, qwen2_5_omni-small, {time.strftime('%Y-%m-%d %H:%M')}, {time.monotonic() - started:.0f} s; "
        f"load average at the end {h.load_average()}",
        "",
        "| exp | metric | ratio | ours (absolute) | seed | goal |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['experiment']} | {r['metric']} | {r['ratio']} | {r['absolute']} | {r['seed']} | {r['goal']} |"
        for r in ROWS
    ]
    text = "\n".join(lines) + "\n"
    (OUT / "summary.md").write_text(text)
    return text


def main() -> None:
    global OUT  # every experiment writes under it
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiments", nargs="+", choices=("all", "p3", "p8", "p7", "p7v", "p4", "p5"))
    parser.add_argument("--rounds", type=int, default=6, help="P3: interleaved rounds")
    parser.add_argument("--p8-requests", type=int, default=30)
    parser.add_argument("--duration", type=float, default=40.0, help="P7/P4: seconds per load point")
    parser.add_argument("--p7v-duration", type=float, default=90.0, help="P7v: seconds per load point")
    parser.add_argument("--p4-clients", type=int, default=4)
    parser.add_argument("--p5-requests", type=int, default=8)
    parser.add_argument("--slo-ttft", type=float, default=6.0)
    parser.add_argument("--slo-itl", type=float, default=0.5)
    parser.add_argument("--size", choices=("tiny", "small"), default="small", help="checkpoint (tiny: smoke runs)")
    parser.add_argument("--out", type=Path, default=h.ROOT / "var" / "experiments", help="JSON, plots, summary.md")
    parser.add_argument("--run-dir", type=Path, default=h.ROOT / "var" / "bench")
    ns = parser.parse_args()
    chosen = set(ns.experiments)
    if "all" in chosen:
        chosen = {"p3", "p8", "p7", "p7v", "p4", "p5"}
    from libs.model.checkpoints import ensure_checkpoint

    OUT = ns.out
    model = ensure_checkpoint("qwen2_5_omni", ns.size)
    configure_tracing("bench", "0.1.0")  # client spans: requests join the servers' traces
    started = time.monotonic()
    print(f"load average at the start: {h.load_average()}")
    run_dir = ns.run_dir / time.strftime("%Y%m%d-%H%M%S")
    steps: list[tuple[str, Callable[[], Any]]] = []
    if chosen & {"p3", "p8"}:
        steps.append(("p3", lambda: p3_p8(model, run_dir, ns.rounds, ns.p8_requests)))
    if "p7" in chosen:

        def split_then_plan() -> None:
            result = p7(model, run_dir, ns.duration, Slo(ns.slo_ttft, ns.slo_itl))
            plan_check(result, run_dir)

        steps.append(("p7", split_then_plan))
    if "p7v" in chosen:
        steps.append(("p7v", lambda: p7_vllm(model, run_dir, ns.p7v_duration, Slo(ns.slo_ttft, ns.slo_itl))))
    if "p4" in chosen:
        steps.append(("p4", lambda: p4(model, run_dir, ns.duration, ns.p4_clients)))
    if "p5" in chosen:
        steps.append(("p5", lambda: p5(model, run_dir, ns.p5_requests, 2)))
    for name, step in steps:
        with contextlib.suppress(KeyboardInterrupt):
            try:
                step()
            except Exception as exc:  # one failed experiment still leaves the others' rows
                print(f"{name} failed: {type(exc).__name__}: {exc}", flush=True)
                ROWS.append(
                    {
                        "experiment": name.upper(),
                        "metric": f"failed: {exc}"[:100],
                        "ratio": "",
                        "absolute": "",
                        "seed": "",
                        "goal": "",
                    }
                )
    print()
    print(write_table(started))
    print(json.dumps({"rows": len(ROWS)}))


if __name__ == "__main__":
    main()
