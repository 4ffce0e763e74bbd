"""Benchmark (not a test; `make bench-conversations`): multi-turn conversations that keep their image,
sent as a chat client sends them (every turn resends the whole conversation, the image in the first
user message), against EPD (both engines, E+PD and E/P/D, 1 and 2 PD / prefill members) and vLLM
(one `vllm serve`; vLLM's own E+PD with 1 and 2 PD servers behind the proxy).

Per cell (conversation length x concurrency), K conversations of T turns: a client slot takes the
next conversation and sends its turns one after another (each turn after the previous answer);
`c` slots run at once, and K is at least c. Measured per cell: TTFT p50 of turn 1 and of the later
turns, their ratio; the prompt tokens a cached prefix held on later turns (usage
`prompt_tokens_details.cached_tokens`, every deployment; vLLM's servers run with
`--enable-prompt-tokens-details`, which only reports); the servers' own counters over the cell
(`vllm:prefix_cache_hits/queries`, EPD's `epd.prefill.prompt_tokens{cached}`); encoder calls in all
and on later turns (EPD: the router's `epd.encode.item` spans per request; vLLM E+PD: the proxy's
record of each request); the encoder's own counts (EPD: `encoder.publish` spans counted in
`epd.stage.duration`, one per Encode call answered, and the items its tower computed); with two
members, the share of later turns on the member that served the conversation's previous turn
(EPD: which PD / prefill member's spans hold the request's trace; vLLM: the proxy's pick) and the
busier member's requests over the other's.

EPD is started as `epd up` starts it (tests/benchmarks/peers/vs_vllm.py `epd_spec`: the door in the
router's process, no placement: `epd up --placement` plans one decoding engine only), plus what the
measure needs: each encoder and PD / prefill member serves /metrics (`--metrics-port`), and the
router and the PD / prefill members record spans to JSONL files (the only per-request record of
which member served; a cost EPD pays and vLLM does not).

Each deployment runs alone: started, warmed up (one conversation of its own), every cell measured,
stopped by PID; repeats interleaved, the order rotated each repeat (A B C, B C A, C A B). Output:
`<out>.json` (every request, every counter) and `<out>.table.md` (default under
var/bench-conversations/; docs/results/conversations.md carries the run of record).

    .venv/bin/python tests/benchmarks/bench_conversations.py --quick
    .venv/bin/python tests/benchmarks/bench_conversations.py --repeats 3 --out var/bench-conversations/run
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import dataclasses
import json
import math
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
import pytest  # noqa: E402

from libs.launch.process import ServiceProcess, free_port  # noqa: E402
from libs.launch.stack import Stack, replica_names  # noqa: E402
from libs.model.checkpoints import ensure_checkpoint  # noqa: E402
from libs.model.media import synthetic  # noqa: E402
from tests.benchmarks.peers import vs_vllm  # noqa: E402

pytestmark = pytest.mark.bench  # a benchmark, never part of make test

FAMILY = "qwen2_5_vl"  # the tiny Qwen2.5-VL, as make bench-vs-vllm


# --- deployments ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Deployment:
    """One deployment of the matrix. EPD: `layout` e+pd or e/p/d, `engine` of its language-model
    services, `members` PD (e+pd) or prefill (e/p/d) replicas. vLLM: `layout` unsplit or e+pd,
    `members` PD servers behind the proxy."""

    name: str
    side: str  # "epd" or "vllm"
    layout: str
    engine: str = "vllm"
    members: int = 1
    encoder_engine: str = "reference"


DEPLOYMENTS = {
    d.name: d
    for d in (
        Deployment("epd-e+pd-ref", "epd", "e+pd", "reference"),
        Deployment("epd-e+pd-ref-x2", "epd", "e+pd", "reference", 2),
        Deployment("epd-e+pd-vllm", "epd", "e+pd", "vllm"),
        Deployment("epd-e+pd-vllm-x2", "epd", "e+pd", "vllm", 2),
        Deployment("epd-e/p/d-ref", "epd", "e/p/d", "reference"),
        Deployment("epd-e/p/d-ref-x2", "epd", "e/p/d", "reference", 2),
        Deployment("epd-e/p/d-vllm", "epd", "e/p/d", "vllm"),
        Deployment("vllm-unsplit", "vllm", "unsplit"),
        Deployment("vllm-e+pd", "vllm", "e+pd"),
        Deployment("vllm-e+pd-x2", "vllm", "e+pd", members=2),
    )
}
# The matrix (`make bench-conversations`): E/P/D on the reference engine only; epd-e/p/d-vllm
# (two vLLM engines, ~70-100 s to start on 2 cores) is measured when --configs names it.
MATRIX = (
    "epd-e+pd-ref", "epd-e+pd-ref-x2", "epd-e+pd-vllm", "epd-e+pd-vllm-x2", "epd-e/p/d-ref", "epd-e/p/d-ref-x2",
    "vllm-unsplit", "vllm-e+pd", "vllm-e+pd-x2",
)  # fmt: skip
UNSPLIT = "vllm-unsplit"


def vllm_peer(dep: Deployment) -> str:
    """vLLM's E+PD with as many PD servers as `dep` has members."""
    return "vllm-e+pd-x2" if dep.members == 2 else "vllm-e+pd"


@dataclass
class Running:
    """A started deployment: where the client goes and where the counters are."""

    dep: Deployment
    base_url: str  # http://HOST:PORT
    model: str
    metrics: dict[str, str] = field(default_factory=dict)  # process name -> its /metrics URL
    members: list[str] = field(default_factory=list)  # PD / prefill process names (EPD) or PD URLs (vLLM)
    spans: dict[str, Path] = field(default_factory=dict)  # process name -> its JSONL span file (EPD)
    proxy: str = ""  # vLLM E+PD: the proxy's base URL (GET /proxy/calls)
    pids: list[int] = field(default_factory=list)


def epd_stack_spec(dep: Deployment, model: Path, run_dir: Path, ready_timeout_s: float) -> tuple[Any, list[str]]:
    """`epd up`'s stack for `dep` (vs_vllm.epd_spec), with /metrics on the encoders and the
    members and spans from the router and the members; returns it and the members' names."""
    spec = vs_vllm.epd_spec(f"epd-{dep.layout}", model, run_dir, ready_timeout_s)
    role = "pd" if dep.layout == "e+pd" else "prefill"
    members = replica_names(role, dep.members)
    others = ["decode"] if dep.layout == "e/p/d" else []
    extra: dict[str, list[str]] = {k: list(v) for k, v in spec.extra_args.items()}
    ports: set[int] = set()
    for name in [*replica_names("encoder", 1), *members, *others]:
        port = free_port()
        while port in ports:  # two free ports in a row can be the same one
            port = free_port()
        ports.add(port)
        extra[name] = [*extra.get(name, []), "--metrics-port", str(port)]
    for name in ["router", *members]:
        extra[name] = [*extra.get(name, []), "--trace-exporter", "jsonl", "--trace-file",
                       str(run_dir / f"spans-{name}.jsonl")]  # fmt: skip
    spec = dataclasses.replace(
        spec,
        engine=dep.engine,
        encoder_engine=dep.encoder_engine,
        pds=dep.members if dep.layout == "e+pd" else 1,
        prefills=dep.members if dep.layout == "e/p/d" else 1,
        extra_args=extra,
    )
    return spec, members


def _metrics_port(args: Sequence[str]) -> int | None:
    args = list(args)
    return int(args[args.index("--metrics-port") + 1]) if "--metrics-port" in args else None


@contextlib.contextmanager
def deployed(dep: Deployment, model: Path, run_dir: Path, ready_timeout_s: float) -> Iterator[Running]:
    """Start `dep`, yield it ready, stop every process it started (by PID)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    name = model.name
    if dep.side == "epd":
        spec, members = epd_stack_spec(dep, model, run_dir, ready_timeout_s)
        with Stack(spec).running() as stack:
            vs_vllm.wait_http(stack.door_url + "/models", [], ready_timeout_s)
            running = Running(dep, stack.door_url.removesuffix("/v1"), name, members=members)
            for proc_name, args in spec.extra_args.items():
                if (port := _metrics_port(args)) is not None:
                    running.metrics[proc_name] = f"http://127.0.0.1:{port}/metrics"
            running.spans = {n: run_dir / f"spans-{n}.jsonl" for n in ["router", *members]}
            running.pids = [p.pid for p in stack.processes.values() if p.process is not None]
            yield running
        return
    procs: list[ServiceProcess] = []
    engine = vs_vllm.Engine()
    storage = run_dir / "ec-storage"
    storage.mkdir(parents=True, exist_ok=True)

    def server(role: str, threads: int, extra: Sequence[str], eager: bool) -> str:
        port = free_port()
        argv = vs_vllm.serve_args(model, name, port, engine, extra, eager)
        proc = ServiceProcess(role, vs_vllm.VLLM_CLI, argv, run_dir / f"{role}.log",
                              env={**vs_vllm.VLLM_ENV, "OMP_NUM_THREADS": str(threads)})  # fmt: skip
        proc.start()
        procs.append(proc)
        return f"http://127.0.0.1:{port}"

    details = ["--enable-prompt-tokens-details"]  # usage.prompt_tokens_details.cached_tokens: reporting only
    try:
        if dep.layout == "unsplit":
            # `vllm serve` as it runs by default (compiled), both cores, as make bench-vs-vllm's unsplit peer.
            url = server("unsplit", 2, details, eager=False)
            vs_vllm.wait_http(url + "/v1/models", procs, ready_timeout_s)
            yield Running(dep, url, name, metrics={"unsplit": url + "/metrics"}, members=[url],
                          pids=[p.pid for p in procs])  # fmt: skip
            return
        # vLLM's E+PD as its examples deploy it (eager), tests/benchmarks/peers/vs_vllm.py `vllm-e+pd`.
        producer = ["--ec-transfer-config", vs_vllm.ec_config("ec_producer", storage)]
        encoder = server("encoder", 1, ["--mm-encoder-only", "--no-enable-prefix-caching", *producer], eager=True)
        pds = [
            server(f"pd-{i}" if dep.members > 1 else "pd", 1,
                   [*details, "--ec-transfer-config", vs_vllm.ec_config("ec_consumer", storage)], eager=True)
            for i in range(dep.members)
        ]  # fmt: skip
        for url in (encoder, *pds):
            vs_vllm.wait_http(url + "/v1/models", procs, ready_timeout_s)
        port = free_port()
        proxy = ServiceProcess("proxy", "tests.benchmarks.peers.vllm_proxy",
                               ["--port", str(port), "--encoder", encoder, "--decode", ",".join(pds)],
                               run_dir / "proxy.log")  # fmt: skip
        proxy.start()
        procs.append(proxy)
        url = f"http://127.0.0.1:{port}"
        vs_vllm.wait_http(url + "/v1/models", procs, 60)
        metrics = {f"pd-{i}": u + "/metrics" for i, u in enumerate(pds)}
        yield Running(dep, url, name, metrics=metrics, members=pds, proxy=url, pids=[p.pid for p in procs])
    finally:
        for proc in reversed(procs):
            proc.stop(timeout_s=20)


# --- conversations ------------------------------------------------------------------------------

_TEXT = (
    "the report says that each river carries stone north of a city with seven bridges and a market where "
    "traders weigh grain salt copper wool and glass before the evening bell while boats wait below"
)
WORDS = tuple(_TEXT.split())


@dataclass(frozen=True)
class Shape:
    """A conversation's size: the image's side (px), words in the first question and in each later
    one, tokens per answer."""

    name: str
    side: int
    first_words: int
    next_words: int
    max_tokens: int = 16


# The tiny checkpoint's tokenizer takes ~3.6 tokens a word of WORDS, and its processor shrinks any
# image to at most 112x112 pixels (16 tokens after the merge). short: ~210 prompt tokens at turn 1
# (past one of vLLM's 128-token blocks on CPU), ~360 by turn 4; long: ~410 at turn 1, ~1,950 by turn 4.
SHAPES = {"short": Shape("short", 224, 40, 8), "long": Shape("long", 224, 100, 130)}


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@dataclass
class Conversation:
    """One conversation's image and questions (its own seed: no two share a prefix)."""

    index: int
    image_url: str
    questions: list[str]
    messages: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def make(cls, shape: Shape, turns: int, seed: int, index: int) -> Conversation:
        rng = random.Random(seed)
        png = synthetic.png_bytes(shape.side, shape.side, seed=seed)
        image = "data:image/png;base64," + base64.b64encode(png).decode()
        first = f"conversation {seed}: look at the picture and " + words(rng, shape.first_words)
        later = [f"then {words(rng, shape.next_words)}" for _ in range(turns - 1)]
        return cls(index, image, [first, *later])

    def next_request(self, turn: int) -> list[dict[str, Any]]:
        """The whole conversation so far, and turn `turn`'s question (turn 0 carries the image)."""
        if turn == 0:
            content: Any = [{"type": "image_url", "image_url": {"url": self.image_url}},
                            {"type": "text", "text": self.questions[0]}]  # fmt: skip
        else:
            content = self.questions[turn]
        self.messages.append({"role": "user", "content": content})
        return self.messages

    def answered(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text or "."})


async def chat_turn(
    session: aiohttp.ClientSession, base_url: str, model: str, messages: list[dict[str, Any]], max_tokens: int,
    request_id: str,
) -> dict[str, Any]:  # fmt: skip
    """One streamed turn: TTFT as `vllm bench serve` reads it (the first chunk with choices), the
    answer's text and the usage chunk."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    out: dict[str, Any] = {"request_id": request_id}
    started = time.perf_counter()
    text: list[str] = []
    async with session.post(f"{base_url}/v1/chat/completions", json=body, headers={"x-request-id": request_id}) as r:
        if r.status != 200:
            out["error"] = f"HTTP {r.status}: {(await r.text())[:300]}"
            return out
        buffer = b""
        async for chunk in r.content.iter_any():
            buffer += chunk
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                line = event.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line.removeprefix("data:").strip()
                if data == "[DONE]":
                    continue
                doc = json.loads(data)
                if choices := doc.get("choices"):
                    if "ttft_ms" not in out:
                        out["ttft_ms"] = (time.perf_counter() - started) * 1e3
                    text.append((choices[0].get("delta") or {}).get("content") or "")
                if usage := doc.get("usage"):
                    out["prompt_tokens"] = usage.get("prompt_tokens")
                    out["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    out["e2e_ms"] = (time.perf_counter() - started) * 1e3
    out["text"] = "".join(text)
    if "ttft_ms" not in out:
        out["error"] = "no token"
    return out


async def run_cell(
    base_url: str, model: str, shape: Shape, conversations: int, turns: int, concurrency: int, seed: int,
    timeout_s: float,
) -> list[dict[str, Any]]:  # fmt: skip
    """K conversations, `concurrency` client slots, each conversation's turns in order; every
    request bounded by `timeout_s`, the cell by 4x that."""
    convs = [Conversation.make(shape, turns, seed * 1000 + i, i) for i in range(conversations)]
    queue: asyncio.Queue[Conversation] = asyncio.Queue()
    for conv in convs:
        queue.put_nowait(conv)
    records: list[dict[str, Any]] = []
    tag = uuid.uuid4().hex[:8]

    async def slot(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            conv = queue.get_nowait()
            for t in range(turns):
                rid = f"conv-{tag}-{conv.index}-t{t}"
                try:
                    rec = await asyncio.wait_for(
                        chat_turn(session, base_url, model, conv.next_request(t), shape.max_tokens, rid), timeout_s
                    )
                except (TimeoutError, aiohttp.ClientError) as exc:
                    rec = {"request_id": rid, "error": f"{type(exc).__name__}: {exc}"[:300]}
                rec |= {"conversation": conv.index, "turn": t}
                records.append(rec)
                if "error" in rec:
                    break  # a conversation without its answer cannot go on
                conv.answered(rec.pop("text", ""))

    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.wait_for(asyncio.gather(*(slot(session) for _ in range(concurrency))), 4 * timeout_s)
    return records


# --- counters -----------------------------------------------------------------------------------

SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})? ([0-9.eE+-]+|NaN|[+-]Inf)$")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def scrape(url: str) -> list[tuple[str, dict[str, str], float]]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        if (m := SAMPLE.match(line)) is not None:
            out.append((m.group(1), dict(LABEL.findall(m.group(2) or "")), float(m.group(3))))
    return out


def counters(samples: list[tuple[str, dict[str, str], float]]) -> dict[str, float]:
    """The counters the benchmark reads from one process's /metrics, summed over label sets."""
    out: defaultdict[str, float] = defaultdict(float)
    for name, labels, value in samples:
        span = labels.get("epd_span", "")
        if name == "epd_stage_duration_seconds_count" and span in ("encoder.publish", "encoder.compute"):
            out[span] += value
        elif name == "epd_cache_computes_total":
            out["encoder.items_computed"] += value
        elif name == "epd_prefill_prompt_tokens_total":
            out["prompt_tokens.cached" if labels.get("epd_cached", "").lower() == "true" else "prompt_tokens.new"] += (
                value
            )
        elif name in ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"):
            out[name.removeprefix("vllm:").removesuffix("_total")] += value
    return dict(out)


def scrape_all(running: Running) -> dict[str, dict[str, float]]:
    return {proc: counters(scrape(url)) for proc, url in running.metrics.items()}


def delta(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    return {
        proc: {k: v - before.get(proc, {}).get(k, 0.0) for k, v in values.items()} for proc, values in after.items()
    }


def proxy_calls(running: Running) -> list[dict[str, Any]]:
    if not running.proxy:
        return []
    with urllib.request.urlopen(running.proxy + "/proxy/calls", timeout=10) as resp:
        calls: list[dict[str, Any]] = json.loads(resp.read())
    return calls


def spans_by_request(spans: dict[str, Path], members: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per request id (the client's x-request-id, the router's `epd.request_id`): its Encode calls
    (the router's `epd.encode.item` spans in its trace) and the member whose spans hold its trace."""
    traces: dict[str, str] = {}  # request id -> trace id
    encodes: Counter[str] = Counter()  # trace id -> Encode calls
    for line in _lines(spans.get("router")):
        span = json.loads(line)
        trace_id = span.get("context", {}).get("trace_id", "")
        attrs = span.get("attributes") or {}
        if rid := attrs.get("epd.request_id"):
            traces[str(rid)] = trace_id
        if span.get("name") == "epd.encode.item":
            encodes[trace_id] += 1
    member_of: dict[str, str] = {}
    for member in members:
        for line in _lines(spans.get(member)):
            member_of.setdefault(json.loads(line).get("context", {}).get("trace_id", ""), member)
    return {rid: {"encode_calls": encodes.get(t, 0), "member": member_of.get(t, "")} for rid, t in traces.items()}


def _lines(path: Path | None) -> list[str]:
    if path is None or not path.exists():
        return []
    return [line for line in path.read_text().splitlines() if line.strip()]


# --- per cell -----------------------------------------------------------------------------------


def p50(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else math.nan


def cell_measures(records: list[dict[str, Any]], counts: dict[str, dict[str, float]], members: int) -> dict[str, Any]:
    """A cell's measures from its requests (each with `encode_calls` and `member` where known) and
    its counter deltas."""
    ok = [r for r in records if "error" not in r]
    first = [r for r in ok if r["turn"] == 0]
    later = [r for r in ok if r["turn"] > 0]
    m: dict[str, Any] = {"requests": len(records), "failed": len(records) - len(ok)}
    m["ttft_first_ms"] = p50([r["ttft_ms"] for r in first])
    m["ttft_later_ms"] = p50([r["ttft_ms"] for r in later])
    m["later_over_first"] = m["ttft_later_ms"] / m["ttft_first_ms"] if m["ttft_first_ms"] else math.nan
    prompt = sum(r.get("prompt_tokens") or 0 for r in later)
    cached = sum(r.get("cached_tokens") or 0 for r in later)
    m["hit_later"] = cached / prompt if prompt else math.nan
    m["prompt_tokens_last_turn"] = p50([r.get("prompt_tokens") or 0 for r in ok if r["turn"] == max(
        (x["turn"] for x in ok), default=0)])  # fmt: skip

    def total(key: str) -> float:
        return sum(v.get(key, 0.0) for v in counts.values())

    if total("prefix_cache_queries"):
        m["hit_counters_all"] = total("prefix_cache_hits") / total("prefix_cache_queries")
    elif total("prompt_tokens.cached") + total("prompt_tokens.new"):
        m["hit_counters_all"] = total("prompt_tokens.cached") / (
            total("prompt_tokens.cached") + total("prompt_tokens.new")
        )
    if total("encoder.publish"):
        m["encoder_answered"] = total("encoder.publish")
        m["encoder_computed"] = total("encoder.items_computed") or total("encoder.compute")
    if any("encode_calls" in r for r in records):
        m["encoder_calls"] = sum(r.get("encode_calls", 0) for r in records)
        m["encoder_calls_later"] = sum(r.get("encode_calls", 0) for r in records if r["turn"] > 0)
    if members > 1:
        by_conv: dict[int, dict[int, str]] = defaultdict(dict)
        for r in ok:
            by_conv[r["conversation"]][r["turn"]] = r.get("member", "")
        same = [turns[t] == turns.get(t - 1) for turns in by_conv.values() for t in turns if t > 0 and turns[t]]
        m["affine_later"] = sum(same) / len(same) if same else math.nan
        load: Counter[str] = Counter()
        busy: defaultdict[str, float] = defaultdict(float)
        for r in ok:
            if r.get("member"):
                load[r["member"]] += 1
                busy[r["member"]] += r["e2e_ms"] / 1e3
        if load:  # a member that served nothing counts as 0 (the ratio is then infinite)
            m["load_ratio"] = _busier_over_other(list(load.values()), members)
            m["busy_ratio"] = _busier_over_other(list(busy.values()), members)
    return m


def _busier_over_other(values: list[float], members: int) -> float:
    per = sorted(values, reverse=True) + [0.0] * max(0, members - len(values))
    return per[0] / per[-1] if per[-1] else math.inf


# --- summary ------------------------------------------------------------------------------------

COLUMNS = (
    ("ttft_first_ms", "TTFT p50 turn 1 (ms)", 1),
    ("ttft_later_ms", "TTFT p50 later turns (ms)", 1),
    ("later_over_first", "later / turn 1", 2),
    ("hit_later", "prefix hit, later turns (usage)", 2),
    ("hit_counters_all", "prefix hit, all turns (server counters)", 2),
    ("encoder_calls", "Encode calls", 0),
    ("encoder_calls_later", "Encode calls, later turns", 0),
    ("encoder_computed", "items the encoder computed", 0),
    ("affine_later", "later turns on the previous turn's member", 2),
    ("load_ratio", "busier / other member, requests", 2),
    ("busy_ratio", "busier / other member, request-seconds", 2),
    ("failed", "failed", 0),
)


def range_of(values: Sequence[float]) -> dict[str, float]:
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not vals:
        return {"n": 0, "median": math.nan, "min": math.nan, "max": math.nan}
    return {"n": len(vals), "median": float(statistics.median(vals)), "min": min(vals), "max": max(vals)}


def fmt(s: dict[str, float], digits: int) -> str:
    if s["n"] == 0:
        return "-"
    one = f"{s['median']:.{digits}f}"
    return one if s["n"] == 1 or s["min"] == s["max"] else f"{one} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def summarise(cells: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Per cell and deployment, each measure's median (min-max) over repeats; and the ratios per
    repeat (EPD against vLLM unsplit and against vLLM's E+PD with as many members)."""
    out: dict[str, Any] = {}
    for cell, by_dep in cells.items():
        figures = {dep: {k: range_of([r.get(k, math.nan) for r in reps]) for k, _, _ in COLUMNS}
                   for dep, reps in by_dep.items()}  # fmt: skip
        ratios: dict[str, dict[str, dict[str, float]]] = {}
        for dep, reps in by_dep.items():
            d = DEPLOYMENTS[dep]
            if d.side != "epd":
                continue
            r: dict[str, list[float]] = defaultdict(list)
            for i, mine in enumerate(reps):
                unsplit = _repeat(by_dep.get(UNSPLIT), i)
                peer = _repeat(by_dep.get(vllm_peer(d)), i)
                if unsplit:
                    r["later_over_first / unsplit's"].append(mine["later_over_first"] / unsplit["later_over_first"])
                    r["hit_later - unsplit's"].append(mine["hit_later"] - unsplit["hit_later"])
                if peer:
                    r["TTFT later / vLLM E+PD's"].append(mine["ttft_later_ms"] / peer["ttft_later_ms"])
            ratios[dep] = {k: range_of(v) for k, v in r.items()}
        met = {dep: targets(figures[dep], ratios[dep], DEPLOYMENTS[dep]) for dep in ratios}
        out[cell] = {"figures": figures, "ratios": ratios, "targets": met}
    return out


# The targets, on medians over repeats: (name, test of an EPD deployment's figures and ratios).
AFFINE_SHARE = 0.95  # of later turns on the member holding the prefix (two members)
LOAD_RATIO = 1.5  # the busier member's requests at most this many times the other's


def targets(fig: dict[str, dict[str, float]], rat: dict[str, dict[str, float]], dep: Deployment) -> dict[str, bool]:
    """Which targets the medians meet (a target without its figures is left out)."""
    checks: dict[str, bool] = {}

    def med(d: dict[str, dict[str, float]], key: str) -> float:
        return d[key]["median"] if key in d and d[key]["n"] else math.nan

    if not math.isnan(v := med(rat, "hit_later - unsplit's")):
        checks["hit >= unsplit"] = v >= 0
    if not math.isnan(v := med(fig, "encoder_calls_later")):
        checks["no later encodes"] = v == 0
    if not math.isnan(v := med(rat, "later_over_first / unsplit's")):
        checks["later/first <= unsplit's"] = v <= 1
    if not math.isnan(v := med(rat, "TTFT later / vLLM E+PD's")):
        checks["later TTFT <= vLLM E+PD"] = v <= 1
    if dep.members > 1 and not math.isnan(v := med(fig, "affine_later")):
        checks[f"affine >= {AFFINE_SHARE:.0%}"] = v >= AFFINE_SHARE
        checks[f"load <= {LOAD_RATIO}x"] = med(fig, "load_ratio") <= LOAD_RATIO
    return checks


def _repeat(reps: list[dict[str, Any]] | None, i: int) -> dict[str, Any] | None:
    return reps[i] if reps and i < len(reps) else None


def table(summary: dict[str, Any]) -> str:
    head = "| cell | deployment | " + " | ".join(label for _, label, _ in COLUMNS) + " |"
    lines = ["### Figures (median (min-max) over repeats)", "", head, "|---|---|" + "---|" * len(COLUMNS)]
    for cell, s in summary.items():
        for dep in DEPLOYMENTS:
            if dep in s["figures"]:
                f = s["figures"][dep]
                lines.append(f"| {cell} | {dep} | " + " | ".join(fmt(f[k], d) for k, _, d in COLUMNS) + " |")
    keys = ("later_over_first / unsplit's", "hit_later - unsplit's", "TTFT later / vLLM E+PD's")
    lines += ["", "### EPD against vLLM, per repeat (median (min-max)); target: ratios <= 1, hit difference >= 0",
              "", "| cell | deployment | " + " | ".join(keys) + " | targets met (medians) | not met |",
              "|---|---|" + "---|" * (len(keys) + 2)]  # fmt: skip
    for cell, s in summary.items():
        for dep, r in s["ratios"].items():
            cells = [fmt(r[k], 2) if k in r else "-" for k in keys]
            met = s.get("targets", {}).get(dep, {})
            cells += [f"{sum(met.values())}/{len(met)}", ", ".join(k for k, ok in met.items() if not ok) or "-"]
            lines.append(f"| {cell} | {dep} (vs {vllm_peer(DEPLOYMENTS[dep])}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --- driver -------------------------------------------------------------------------------------


def rotated(configs: Sequence[str], repeat: int) -> list[str]:
    """The deployments in repeat `repeat`'s order: rotated by one each repeat."""
    k = repeat % len(configs) if configs else 0
    return [*configs[k:], *configs[:k]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 repeat, c=1,4, 3 turns")
    parser.add_argument("--configs", default=",".join(MATRIX), help=f"comma-separated, of: {', '.join(DEPLOYMENTS)}")
    parser.add_argument("--shapes", default="short,long")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--conversations", type=int, default=8, help="per cell; at least the cell's concurrency")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ready-timeout-s", type=float, default=420.0)
    parser.add_argument("--request-timeout-s", type=float, default=120.0)
    parser.add_argument("--out", default="var/bench-conversations/run", help="path prefix of .json and .table.md")
    parser.add_argument("--from-json", default="", help="the table again from an earlier --out's JSON")
    ns = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))
    if ns.quick:
        ns.concurrency, ns.repeats, ns.turns = "1,4", 1, 3
    configs = [c for c in ns.configs.split(",") if c]
    if bad := [c for c in configs if c not in DEPLOYMENTS]:
        parser.error(f"--configs: unknown {bad}; known: {', '.join(DEPLOYMENTS)}")
    shapes = [s for s in ns.shapes.split(",") if s]
    if bad := [s for s in shapes if s not in SHAPES]:
        parser.error(f"--shapes: unknown {bad}; known: {', '.join(SHAPES)}")
    concurrencies = [int(c) for c in ns.concurrency.split(",") if c]
    if ns.from_json:
        doc = json.loads((ROOT / ns.from_json).read_text())
        for by_dep in doc["cells"].values():  # measures again from the requests and counters, with this version's maths
            for dep, reps in by_dep.items():
                for i, rep in enumerate(reps):
                    kept = {k: rep[k] for k in ("records", "counters", "error") if k in rep}
                    reps[i] = cell_measures(rep["records"], rep["counters"], DEPLOYMENTS[dep].members) | kept
        print(table(summarise(doc["cells"])))
        return
    model = ensure_checkpoint(FAMILY, "tiny")
    work = ROOT / "var/run/bench-conversations"
    cells: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    runs: list[dict[str, Any]] = []
    started = time.time()
    cell_names = [f"{shape} c={conc}" for shape in shapes for conc in concurrencies]
    for repeat in range(ns.repeats):
        for config in rotated(configs, repeat):
            dep = DEPLOYMENTS[config]
            run_dir = work / f"r{repeat}-{config.replace('/', '_')}"
            record: dict[str, Any] = {"repeat": repeat, "config": config, "load_before": os.getloadavg()}
            t0 = time.monotonic()
            for attempt in range(2):  # a start that fails (a port taken meanwhile, say) is tried once more
                record.pop("error", None)
                where = run_dir if attempt == 0 else run_dir.with_name(run_dir.name + "-again")
                measured = measure(ns, dep, model, where, repeat, shapes, concurrencies, record, started)
                if "error" not in record or "start_s" in record:
                    break
                record["first_start_error"] = record["error"]
            by_cell = {cell: (records, counts) for cell, records, counts in measured}
            for cell in cell_names:  # a cell not measured stays in place (no figures), so repeats pair up
                records, counts = by_cell.get(cell, ([], {}))
                m = cell_measures(records, counts, dep.members)
                m |= {"records": records, "counters": counts}
                if cell not in by_cell:
                    m["error"] = record.get("error", "not measured")
                cells[cell][config].append(m)
            record["wall_s"] = round(time.monotonic() - t0, 1)
            record["load_after"] = os.getloadavg()
            runs.append(record)
            write(ns, model, cells, runs, final=False)
    text = write(ns, model, cells, runs, final=True)
    print(text)
    print(f"total {time.time() - started:.0f} s")


Measured = list[tuple[str, list[dict[str, Any]], dict[str, dict[str, float]]]]


def measure(
    ns: argparse.Namespace, dep: Deployment, model: Path, run_dir: Path, repeat: int, shapes: Sequence[str],
    concurrencies: Sequence[int], record: dict[str, Any], started: float,
) -> Measured:  # fmt: skip
    """Start `dep`, warm it up, run every cell, stop it; each cell's requests (with their Encode
    calls and member where known) and counter deltas. Failures go into `record["error"]`."""
    measured: Measured = []
    calls: list[dict[str, Any]] = []
    running: Running | None = None
    t0 = time.monotonic()
    try:
        with deployed(dep, model, run_dir, ns.ready_timeout_s) as running:
            record["start_s"] = round(time.monotonic() - t0, 1)
            record["pids"] = running.pids
            asyncio.run(run_cell(running.base_url, running.model, SHAPES["short"], 1, 2, 1,
                                 seed=900_000 + repeat, timeout_s=ns.request_timeout_s))  # warm-up  # fmt: skip
            for s, shape_name in enumerate(shapes):
                for c, conc in enumerate(concurrencies):
                    cell = f"{shape_name} c={conc}"
                    before = scrape_all(running)
                    seed = 10_000 * (repeat + 1) + 100 * s + c
                    try:
                        records = asyncio.run(run_cell(
                            running.base_url, running.model, SHAPES[shape_name], max(ns.conversations, conc),
                            ns.turns, conc, seed, ns.request_timeout_s))  # fmt: skip
                    except TimeoutError:
                        records = [{"request_id": "", "turn": 0, "conversation": -1, "error": "cell timed out"}]
                    measured.append((cell, records, delta(before, scrape_all(running))))
                    ok = [r for r in records if "error" not in r]
                    first = p50([r["ttft_ms"] for r in ok if r["turn"] == 0])
                    later = p50([r["ttft_ms"] for r in ok if r["turn"] > 0])
                    print(f"[{time.time() - started:6.0f}s] r{repeat} {dep.name} {cell}: {len(ok)}/{len(records)} ok, "
                          f"TTFT p50 first {first:.1f} later {later:.1f} ms", flush=True)  # fmt: skip
            calls = proxy_calls(running)
    except Exception as exc:  # a deployment that cannot start or run here is a result too
        record["error"] = f"{type(exc).__name__}: {str(exc)[-1500:]}"
        print(f"r{repeat} {dep.name}: FAILED {record['error'][-600:]}", flush=True)
    # After the stop: every span file is flushed.
    per_request: dict[str, dict[str, Any]] = {}
    if dep.side == "epd" and measured and running is not None:
        per_request = spans_by_request(running.spans, running.members)
    for call in calls:
        per_request[call["request_id"]] = {"encode_calls": int(call["encoder"]), "member": call["decode"]}
    for _, records, _ in measured:
        for r in records:
            if dep.layout != "unsplit" and r["request_id"] in per_request:
                r |= per_request[r["request_id"]]
    return measured


def write(
    ns: argparse.Namespace, model: Path, cells: dict[str, Any], runs: list[dict[str, Any]], *, final: bool
) -> str:
    summary = summarise(cells)
    text = table(summary)
    out = ROOT / ns.out
    out.parent.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    doc = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "commit": commit.stdout.strip(),
        "complete": final,
        "host": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "checkpoint": f"{FAMILY} tiny ({model.name})",
        "args": vars(ns),
        "runs": runs,
        "cells": cells,
        "summary": summary,
    }
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    out.with_suffix(".table.md").write_text(text + "\n")
    if final:
        print(f"wrote {out}.json, {out}.table.md")
    return text


if __name__ == "__main__":
    main()
