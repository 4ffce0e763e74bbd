"""`make bench-vs-vllm`: EPD on vLLM behind its OpenAI door against vLLM's own deployments, all
measured by vLLM's own client (`vllm bench serve`), each configuration alone on the host.

Configurations (same checkpoint, same requests: `bench serve --seed`):

- `epd-e+pd`, `epd-e/p/d`: EPD on vLLM (the reference encoder) behind its OpenAI door, placed
  where `epd up` places it (`default_door_placement`, libs/launch/stack.py: the router's process);
  `epd-e+pd-vllmenc`, `epd-e/p/d-vllmenc`: the same with the encoder on vLLM too
  (`services/encoder --engine vllm`); `epd-e+pd-doorproc`, `epd-e/p/d-doorproc`: the other
  placement, the door as a process of its own (`epd up --door-placement process`);
  `epd-e/p/d-dgate`: the router starts no prefill its decode has no slot for, told the decode's
  batch (`--decode-in-flight 8`; since contract 1.7 the router's default reads the same bound from
  the decode); `epd-e/p/d-nogate`: no such bound (`--decode-in-flight 0`, the default before 1.7);
  `epd-e+pd-unbatched`, `epd-e+pd-vllmenc-unbatched`: the PD letting every request into vLLM as it
  arrives (`--prefill-batch-steps 0`, the earlier default), not in rounds;
  `epd-e+pd-fixedchunks`: the PD prefilling prompts in chunks of `--prefill-chunk-tokens` whatever
  the load (`--no-prefill-chunk-fair-share`, the earlier default), not whole when few
  requests share the step;
  `epd-e+pd-placed`, `epd-e+pd-vllmenc-placed`, `epd-e/p/d-placed`, `epd-e/p/d-vllmenc-placed`: the
  stack placed on the host (libs/launch/placement.py: the decoding engine alone on a CPU);
  `epd-e+pd-traced`, `epd-e/p/d-traced`: every EPD service recording its spans (JSONL exporter, a file
  under the run directory; the others export none and so record none, as vLLM without
  `--otlp-traces-endpoint`);
- `vllm-e+pd`: vLLM's own E+PD as it documents it: an encoder-only `vllm serve` (EC producer,
  ECExampleConnector on a shared directory under var/) and a PD `vllm serve` (EC consumer), behind
  `tests.benchmarks.peers.vllm_proxy` (what vLLM's example EPD proxy does);
- `vllm-e/p/d`: the same encoder, a prefill `vllm serve` (EC consumer, NixlConnector kv_producer)
  and a decode `vllm serve` (NixlConnector kv_consumer) behind the same proxy;
- `vllm-unsplit`: one `vllm serve`;
- `vllm-e+pd-placed`: vLLM's E+PD given EPD's placement (its PD server's model worker alone on a
  CPU, `VLLM_CPU_OMP_THREADS_BIND`; the encoder at nice 19, the proxy beside the PD server);
- `vllm-e+pd-uni` (`vllm-e/p/d-uni`, `vllm-unsplit-uni`): vLLM's deployment given the
  engine-process setting EPD runs with on CPU (each `vllm serve` with
  `--distributed-executor-backend uni` and `VLLM_ENABLE_V1_MULTIPROCESSING=0`: the model inside
  EngineCore, no Worker process: docs/vllm.md, "One engine process"), to show what of EPD's lead
  that setting alone explains. Not vLLM's documented deployment: the ratios stay against
  `vllm-e+pd` / `vllm-e/p/d`;
- `...-compiled` (`vllm-e+pd-compiled`, `vllm-e/p/d-compiled`, `vllm-unsplit-compiled`, and the
  EPD ones): the engines that run the language model compiled by vLLM (`--no-enforce-eager`,
  vLLM's own default; its EPD examples deploy `--enforce-eager`, so `vllm-e+pd` runs eager). EPD's
  services compile by default (every EPD configuration ran eager before); for EPD the suffix only
  names it. Encoders run eager on both sides. Ratios are given against the peer
  as documented and against it compiled, and against one unsplit `vllm serve` both ways;
- `epd-e/p/d-placed-eager`, `epd-e+pd-placed-eager`: EPD's language-model engines eager (`--enforce-eager`,
  EPD's earlier default); `epd-e/p/d-placed-prefilleager`, `epd-e/p/d-placed-decodeeager`:
  only the prefill service's engine, or only the decode's: what compiling buys or costs per role.

Suffixes combine in any order (`epd-e+pd-vllmenc-placed-compiled`).

This module holds the pure parts (run schedule, bench serve's arguments, result parsing, ratio
maths, table) and the process handling; tests/benchmarks/bench_vs_vllm.py drives it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from libs.launch.placement import Placement
from libs.launch.process import ROOT, ServiceProcess, free_port
from libs.launch.stack import DOOR_PROCESS as DOOR_PROCESS_PLACEMENT
from libs.launch.stack import Stack, StackSpec, default_door_placement

VLLM_CLI = "tests.benchmarks.peers.vllm_cli"  # vLLM's own CLI, run as a module (its console script is not installed)

CONFIGS = (
    "epd-e+pd", "epd-e+pd-vllmenc", "vllm-e+pd", "vllm-unsplit", "epd-e/p/d", "epd-e/p/d-vllmenc", "vllm-e/p/d",
    "vllm-e+pd-uni", "vllm-e/p/d-uni", "vllm-unsplit-uni", "epd-e+pd-doorproc", "epd-e/p/d-doorproc",
    "epd-e/p/d-dgate", "epd-e+pd-traced", "epd-e/p/d-traced",
    "epd-e/p/d-nogate", "epd-e+pd-vllmenc-traced", "epd-e+pd-unbatched", "epd-e+pd-vllmenc-unbatched",
    "epd-e+pd-fixedchunks", "epd-e+pd-placed", "epd-e+pd-vllmenc-placed", "vllm-e+pd-placed",
    "epd-e/p/d-placed", "epd-e/p/d-vllmenc-placed",
    "epd-e+pd-placed-compiled", "epd-e+pd-vllmenc-placed-compiled", "vllm-e+pd-compiled",
    "epd-e/p/d-placed-compiled", "epd-e/p/d-vllmenc-placed-compiled", "vllm-e/p/d-compiled", "vllm-unsplit-compiled",
    "epd-e/p/d-placed-eager", "epd-e/p/d-placed-prefilleager", "epd-e/p/d-placed-decodeeager",
    "epd-e+pd-placed-eager", "epd-e+pd-placed-traced", "epd-e+pd-vllmenc-placed-traced",
)  # fmt: skip
# The issue's matrix, `make bench-vs-vllm`'s: EPD as `epd up --placement` runs it, both encoders,
# against vLLM's documented deployments and one unsplit `vllm serve`. The other configurations
# are the variants measured on the way (docs/results/bench-vs-vllm.md).
MATRIX = (
    "epd-e+pd-placed", "epd-e+pd-vllmenc-placed", "vllm-e+pd", "vllm-e+pd-compiled",
    "epd-e/p/d-placed", "epd-e/p/d-vllmenc-placed", "vllm-e/p/d", "vllm-unsplit-compiled",
)  # fmt: skip
ONE_PROCESS = "-uni"  # suffix: vLLM's servers with the model inside EngineCore (no Worker process)
VLLM_ENCODER = "-vllmenc"  # suffix: EPD's encoder on vLLM too
DOOR_PROCESS = "-doorproc"  # suffix: EPD's door as a process of its own (else placed as `epd up` places it)
DECODE_GATE = "-dgate"  # suffix: the router starts no prefill its decode has no slot for (`--decode-in-flight`)
NO_DECODE_GATE = "-nogate"  # suffix: prefills run ahead of decode (`--decode-in-flight 0`)
TRACED = "-traced"  # suffix: every EPD service records its spans (JSONL exporter)
UNBATCHED = "-unbatched"  # suffix: the PD lets every request into vLLM at once (`--prefill-batch-steps 0`)
FIXED_CHUNKS = "-fixedchunks"  # suffix: the PD prefills 64-token chunks at any load (`--no-prefill-chunk-fair-share`)
# suffix: the decoding engine (PD's, decode's) alone on a CPU, the encoders at nice 19 (libs/launch/placement.py); for
# vLLM's E+PD the same plan with vLLM's own knob for its PD's model worker (`VLLM_CPU_OMP_THREADS_BIND`)
PLACED = "-placed"
# suffix: the engines that run the language model (PD's; prefill's and decode's) compiled by vLLM
# (`--no-enforce-eager`: vLLM's own default, its EPD examples deploy `--enforce-eager`; EPD's services'
# default too, so for EPD the suffix only names it); encoders stay eager
COMPILED = "-compiled"
# suffixes: the prefill service's engine, the decode's, or every language-model engine run eager
# (`--enforce-eager`, EPD's earlier default): which role's compiled graph costs what
PREFILL_EAGER = "-prefilleager"
DECODE_EAGER = "-decodeeager"
EAGER = "-eager"
# `-gate` configurations: the router's decode bound, the vLLM peers' max_num_seqs (EPD's decode
# defaults to 32).
DECODE_SLOTS = 8
# Each EPD configuration and the vLLM deployment it would replace (the ratios EPD / peer).
PEERS = {
    "epd-e+pd": "vllm-e+pd", "epd-e+pd-vllmenc": "vllm-e+pd",
    "epd-e/p/d": "vllm-e/p/d", "epd-e/p/d-vllmenc": "vllm-e/p/d",
    "epd-e+pd-doorproc": "vllm-e+pd", "epd-e/p/d-doorproc": "vllm-e/p/d",
    "epd-e/p/d-dgate": "vllm-e/p/d",
    "epd-e+pd-traced": "vllm-e+pd", "epd-e/p/d-traced": "vllm-e/p/d", "epd-e/p/d-nogate": "vllm-e/p/d",
    "epd-e+pd-vllmenc-traced": "vllm-e+pd",
    "epd-e+pd-unbatched": "vllm-e+pd", "epd-e+pd-vllmenc-unbatched": "vllm-e+pd",
    "epd-e+pd-fixedchunks": "vllm-e+pd", "epd-e+pd-placed": "vllm-e+pd", "epd-e+pd-vllmenc-placed": "vllm-e+pd",
    "epd-e/p/d-placed": "vllm-e/p/d", "epd-e/p/d-vllmenc-placed": "vllm-e/p/d",
    "epd-e+pd-placed-compiled": "vllm-e+pd", "epd-e+pd-vllmenc-placed-compiled": "vllm-e+pd",
    "epd-e/p/d-placed-compiled": "vllm-e/p/d", "epd-e/p/d-vllmenc-placed-compiled": "vllm-e/p/d",
    "epd-e/p/d-placed-eager": "vllm-e/p/d", "epd-e/p/d-placed-prefilleager": "vllm-e/p/d",
    "epd-e/p/d-placed-decodeeager": "vllm-e/p/d", "epd-e+pd-placed-eager": "vllm-e+pd",
    "epd-e+pd-placed-traced": "vllm-e+pd", "epd-e+pd-vllmenc-placed-traced": "vllm-e+pd",
}  # fmt: skip
UNSPLIT = "vllm-unsplit"

# Metrics read from bench serve's result JSON: (key in the JSON, label, lower is better).
METRICS: tuple[tuple[str, str, bool], ...] = (
    ("median_ttft_ms", "TTFT p50 (ms)", True),
    ("p90_ttft_ms", "TTFT p90 (ms)", True),
    ("p99_ttft_ms", "TTFT p99 (ms)", True),
    ("median_tpot_ms", "TPOT p50 (ms)", True),
    # The same over the answers that streamed (`streamed_tpot`): per token where both sides stream.
    ("streamed_tpot_ms", "TPOT p50, streamed (ms)", True),
    # End to end per request: the fair per-request figure where a server sends its tokens in
    # bursts (TPOT then reads near 0 and TTFT carries the wait).
    ("median_e2el_ms", "E2E p50 (ms)", True),
    ("request_throughput", "req/s", False),
    ("output_throughput", "out tok/s", False),
)
# How a server's answers reached the client, shown beside the figures (no ratio: neither more nor
# fewer is better): the median over requests of the separate moments a streamed answer delivered
# tokens. 16 output tokens streamed one by one read 16; an answer sent in one burst reads 1, and
# then its TPOT reads ~0 while its TTFT carries the whole wait.
ARRIVALS = ("median_arrivals", "arrivals/answer p50")
ARRIVAL_GAP_S = 0.001  # a token read within 1 ms of the one before came in the same burst
# The share of answers that streamed, shown beside the figures too (no ratio): an answer whose
# tokens reached the client at this many separate moments or more streamed; one with fewer came in
# one or two bursts (the usage chunk may trail a burst), its wait all in its TTFT.
STREAMED = ("streamed_share", "streamed answers %")
STREAMED_MIN_ARRIVALS = 3
SIDE_COLUMNS = (ARRIVALS, STREAMED)


@dataclass(frozen=True)
class Dataset:
    """One `random-mm` shape: images per request (224x224 each), text tokens in, tokens out."""

    name: str
    images: int
    input_len: int = 32
    output_len: int = 16
    side: int = 224

    def args(self) -> list[str]:
        return [
            "--dataset-name", "random-mm",
            "--random-input-len", str(self.input_len), "--random-range-ratio", "0",
            "--random-output-len", str(self.output_len),
            "--random-mm-base-items-per-request", str(self.images), "--random-mm-num-mm-items-range-ratio", "0",
            "--random-mm-limit-mm-per-prompt", json.dumps({"image": self.images, "video": 0}),
            "--random-mm-bucket-config", f"{{({self.side},{self.side},1): 1.0}}",
        ]  # fmt: skip


DATASETS = {"1img": Dataset("1img", 1), "3img": Dataset("3img", 3)}


@dataclass(frozen=True)
class Point:
    """One measured point: a dataset at a concurrency, with its own request seed (the same for
    every configuration; a new seed per point keeps one start's prefix caches from serving the
    next point's requests)."""

    dataset: str
    concurrency: int
    prompts: int
    seed: int
    request_rate: float = math.inf  # requests/s bench serve sends at most (Poisson); inf: as fast as answered


def points(
    datasets: Sequence[str], concurrencies: Sequence[int], prompts: int, prompts_at_64: int, rate: float = math.inf
) -> list[Point]:
    out = []
    for d, name in enumerate(datasets):
        for c, conc in enumerate(concurrencies):
            n = prompts_at_64 if conc >= 64 else prompts
            out.append(Point(name, conc, max(n, conc), seed=1000 + 100 * d + c, request_rate=rate))
    return out


def schedule(configs: Sequence[str], repeats: int) -> list[tuple[int, str]]:
    """Interleaved runs (A B C A B C ...): a slow spell on the host hits every configuration."""
    return [(r, c) for r in range(repeats) for c in configs]


def bench_serve_args(
    *, base_url: str, model: str, tokenizer: str, dataset: Dataset, point: Point, result_dir: Path, filename: str
) -> list[str]:
    """vLLM's `bench serve` arguments for one point (openai-chat, streamed, --ignore-eos)."""
    return [
        "bench", "serve", "--backend", "openai-chat", "--base-url", base_url, "--endpoint", "/v1/chat/completions",
        "--model", model, "--tokenizer", tokenizer, *dataset.args(),
        "--num-prompts", str(point.prompts), "--max-concurrency", str(point.concurrency),
        "--request-rate", str(point.request_rate), "--seed", str(point.seed), "--ignore-eos", "--disable-tqdm",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
        "--save-result", "--save-detailed", "--result-dir", str(result_dir), "--result-filename", filename,
    ]  # fmt: skip


def _answers(result: dict[str, Any]) -> list[tuple[int, float, float, int]]:
    """Per answered request (`--save-detailed`'s lists; none without them): its token arrivals
    (separate moments, gaps of `ARRIVAL_GAP_S` or more), TTFT and latency (s), output tokens."""
    details = zip(result.get("ttfts") or [], result.get("itls") or [], result.get("latencies") or [],
                  result.get("output_lens") or [], strict=False)  # fmt: skip
    return [
        (1 + sum(1 for gap in gaps if gap >= ARRIVAL_GAP_S), ttft, latency, tokens)
        for ttft, gaps, latency, tokens in details
        if ttft and ttft > 0
    ]


def arrivals(result: dict[str, Any]) -> float:
    """The median over answered requests of their token arrivals (NaN without the details)."""
    counts = [count for count, *_ in _answers(result)]
    return float(statistics.median(counts)) if counts else math.nan


def streamed_share(result: dict[str, Any]) -> float:
    """The share of answered requests, in percent, that streamed (`STREAMED_MIN_ARRIVALS`)."""
    answers = _answers(result)
    streamed = sum(1 for count, *_ in answers if count >= STREAMED_MIN_ARRIVALS)
    return 100.0 * streamed / len(answers) if answers else math.nan


def streamed_tpot(result: dict[str, Any]) -> float:
    """bench serve's TPOT, (latency - TTFT) / (output tokens - 1) in ms, median over the answers
    that streamed only: a burst answer reads ~0 there while its TTFT carries its wait, so bench
    serve's own TPOT p50 of a server that bursts half its answers says little per token."""
    tpots = [
        1000.0 * (latency - ttft) / (tokens - 1)
        for count, ttft, latency, tokens in _answers(result)
        if count >= STREAMED_MIN_ARRIVALS and tokens > 1
    ]
    return float(statistics.median(tpots)) if tpots else math.nan


def metrics_of(result: dict[str, Any]) -> dict[str, float]:
    """The metrics this benchmark reports, from one bench serve result JSON (NaN when absent)."""
    out = {key: float(result.get(key, math.nan)) for key, _, _ in METRICS}
    out["streamed_tpot_ms"] = streamed_tpot(result)
    out[ARRIVALS[0]] = arrivals(result)
    out[STREAMED[0]] = streamed_share(result)
    out["completed"] = float(result.get("completed", 0))
    out["failed"] = float(result.get("failed", 0))
    return out


def median_range(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max of the finite values (NaN each when none)."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "n": 0}
    return {"median": statistics.median(finite), "min": min(finite), "max": max(finite), "n": len(finite)}


def ratios(ours: Sequence[float], peers: Sequence[float]) -> list[float]:
    """EPD / peer per repeat (pairs by repeat index: the two ran back to back); a pair with a
    missing or zero side is left out."""
    return [a / b for a, b in zip(ours, peers, strict=False) if math.isfinite(a) and math.isfinite(b) and b > 0]


def wins(metric: str, summary: dict[str, float]) -> bool:
    """Whether the whole range of a ratio is on EPD's side of 1.0."""
    lower = next(low for key, _, low in METRICS if key == metric)
    if summary["n"] == 0:
        return False
    return summary["max"] <= 1.0 if lower else summary["min"] >= 1.0


@dataclass
class Results:
    """Every run's metrics: runs[config][dataset][concurrency] = one dict per repeat (or an error)."""

    runs: dict[str, dict[str, dict[int, list[dict[str, Any]]]]] = field(default_factory=dict)
    errors: dict[str, list[str]] = field(default_factory=dict)

    def add(self, config: str, point: Point, metrics: dict[str, Any]) -> None:
        self.runs.setdefault(config, {}).setdefault(point.dataset, {}).setdefault(point.concurrency, []).append(metrics)

    def values(self, config: str, dataset: str, concurrency: int, key: str) -> list[float]:
        return [float(m.get(key, math.nan)) for m in self.runs.get(config, {}).get(dataset, {}).get(concurrency, [])]

    def summary(self) -> dict[str, Any]:
        """Per point: each configuration's median/range of every metric, and each EPD/peer (vLLM's
        deployment, and the same with one engine process where that ran) and config/unsplit
        ratio's median/range."""
        out: dict[str, Any] = {}
        for config, by_dataset in self.runs.items():
            for dataset, by_conc in by_dataset.items():
                for conc in by_conc:
                    point = out.setdefault(f"{dataset}@c{conc}", {"configs": {}, "vs_peer": {}, "vs_unsplit": {}})
                    point["configs"][config] = {
                        key: median_range(self.values(config, dataset, conc, key))
                        for key in (*(key for key, _, _ in METRICS), *(key for key, _ in SIDE_COLUMNS))
                    }
                    peer = PEERS.get(config)
                    for target, name in (
                        (peer, "vs_peer"),
                        (peer + ONE_PROCESS if peer else None, "vs_peer"),  # where it ran too
                        (peer + COMPILED if peer else None, "vs_peer"),
                        (UNSPLIT if config != UNSPLIT else None, "vs_unsplit"),
                        (UNSPLIT + COMPILED if not config.startswith(UNSPLIT) else None, "vs_unsplit"),
                    ):
                        if target is None or target not in self.runs:
                            continue
                        point[name][f"{config}/{target}"] = {
                            key: median_range(ratios(self.values(config, dataset, conc, key),
                                                     self.values(target, dataset, conc, key)))
                            for key, _, _ in METRICS
                        }  # fmt: skip
        return out


def _cell(s: dict[str, float], digits: int = 1) -> str:
    if s["n"] == 0:
        return "-"
    if s["n"] == 1 or s["min"] == s["max"]:
        return f"{s['median']:.{digits}f}"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def table(summary: dict[str, Any]) -> str:
    """Markdown: each point's configurations (median (min-max) over repeats), then the ratios."""
    head = "| point | configuration | " + " | ".join(label for _, label, _ in METRICS) + " |"
    rule = "|---|---|" + "---|" * len(METRICS)
    side_head = " | ".join(label for _, label in SIDE_COLUMNS)
    side_rule = "---|" * len(SIDE_COLUMNS)
    lines = ["### Figures (median (min-max) over repeats)", "", f"{head} {side_head} |", rule + side_rule]
    for name, point in summary.items():
        for config in CONFIGS:
            if config in point["configs"]:
                m = point["configs"][config]
                # A run from before a column reads "-" there (no values: median_range's n is 0).
                cells = [_cell(m[k]) for k, _, _ in METRICS] + [_cell(m[k]) for k, _ in SIDE_COLUMNS]
                lines.append(f"| {name} | {config} | " + " | ".join(cells) + " |")
    lines += ["", "### Ratios EPD / peer and each / unsplit (median (min-max) over repeats; "
              "**bold**: the whole range on EPD's side of 1.0)", "",
              head.replace("configuration", "ratio"), rule]  # fmt: skip
    for name, point in summary.items():
        for group in ("vs_peer", "vs_unsplit"):
            for ratio, m in point[group].items():
                cells = []
                for key, _, _ in METRICS:
                    text = _cell(m[key], 2)
                    cells.append(f"**{text}**" if group == "vs_peer" and wins(key, m[key]) else text)
                lines.append(f"| {name} | {ratio} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(summary: dict[str, Any], path: Path) -> bool:
    """TTFT p50 and output tokens/s against concurrency, one line per configuration and dataset
    (median, whiskers min-max); False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    series: dict[tuple[str, str], list[tuple[int, dict[str, Any]]]] = {}
    for name, point in summary.items():
        dataset, conc = name.split("@c")
        for config, m in point["configs"].items():
            series.setdefault((config, dataset), []).append((int(conc), m))
    for (config, dataset), pts in sorted(series.items()):
        pts.sort()
        xs = [c for c, _ in pts]
        for ax, key in zip(axes, ("median_ttft_ms", "output_throughput"), strict=True):
            med = [m[key]["median"] for _, m in pts]
            low = [m[key]["median"] - m[key]["min"] for _, m in pts]
            high = [m[key]["max"] - m[key]["median"] for _, m in pts]
            ax.errorbar(xs, med, yerr=[low, high], marker="o", capsize=3, label=f"{config} {dataset}",
                        linestyle="-" if config.startswith("epd") else "--")  # fmt: skip
    for ax, label in zip(axes, ("TTFT p50 (ms)", "output tokens/s"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].legend(fontsize=7)
    fig.suptitle("EPD on vLLM (door) vs vLLM's own deployments, vllm bench serve, 2 CPU cores")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# --- processes --------------------------------------------------------------------------------

VLLM_ENV = {
    # Loopback only, quiet; each split server gets one OpenMP thread unbound (as EPD's services on
    # vLLM do, libs/backends/vllm/runtime.py), the unsplit one both cores.
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
    "UCX_NET_DEVICES": "lo",
    "UCX_MODULES": "^ib",
    "NIXL_LOG_LEVEL": "WARN",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_TARGET_DEVICE": "cpu",
}


@dataclass(frozen=True)
class Engine:
    """What EPD's services on vLLM run with (libs/backends/vllm/runtime.py), given to vLLM's servers."""

    kv_cache_mib: int = 64
    max_num_seqs: int = 8
    max_model_len: int = 4096


def serve_args(
    model: Path, name: str, port: int, engine: Engine, extra: Sequence[str] = (), eager: bool = True
) -> list[str]:
    return [
        "serve", str(model), "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager" if eager else "--no-enforce-eager", "--seed", "0",
        "--kv-cache-memory-bytes", str(engine.kv_cache_mib << 20),
        "--max-num-seqs", str(engine.max_num_seqs), "--max-model-len", str(engine.max_model_len),
        "--enable-request-id-headers", "--disable-uvicorn-access-log", *extra,
    ]  # fmt: skip


def ec_config(role: str, storage: Path) -> str:
    return json.dumps({"ec_connector": "ECExampleConnector", "ec_role": role,
                       "ec_connector_extra_config": {"shared_storage_path": str(storage)}})  # fmt: skip


def kv_config(role: str) -> str:
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"})


def wait_http(url: str, procs: Sequence[ServiceProcess], timeout_s: float) -> None:
    """Until GET url answers 200; a process of the configuration exiting first ends the wait."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for p in procs:
            if not p.alive():
                raise RuntimeError(f"{p.name} exited before {url} answered:\n{p.log_tail(25)}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as resp:
            if resp.status == 200:
                return
        time.sleep(0.5)  # a readiness probe: the server's own /v1/models is the event
    raise RuntimeError(f"{url} did not answer within {timeout_s:.0f} s")


@dataclass
class Deployment:
    """A started configuration: where bench serve goes, and what to stop."""

    config: str
    base_url: str  # http://HOST:PORT (bench serve adds the endpoint)
    model: str  # the name bench serve must use
    procs: list[ServiceProcess] = field(default_factory=list)
    stack: Stack | None = None
    note: str = ""

    def pids(self) -> list[int]:
        pids = [p.pid for p in self.procs if p.process is not None]
        if self.stack is not None:
            pids += [p.pid for p in self.stack.processes.values() if p.process is not None]
        return pids


# EPD's configuration suffixes, in the order `deployed` reads them
EPD_SUFFIXES = (DOOR_PROCESS, DECODE_GATE, NO_DECODE_GATE, TRACED, UNBATCHED, FIXED_CHUNKS, PLACED,
                VLLM_ENCODER, COMPILED, PREFILL_EAGER, DECODE_EAGER, EAGER)  # fmt: skip


def without_suffixes(name: str, suffixes: Sequence[str]) -> tuple[str, frozenset[str]]:
    """`name` less the `suffixes` it ends with, in any order, and which those were."""
    found: set[str] = set()
    while (end := next((s for s in suffixes if name.endswith(s)), None)) is not None:
        found.add(end)
        name = name.removesuffix(end)
    return name, frozenset(found)


def epd_spec(config: str, model: Path, run_dir: Path, ready_timeout_s: float) -> StackSpec:
    """The stack of an `epd-*` configuration: EPD as `epd up` starts it (its door where `epd up`
    places it by default, `default_door_placement`), with the configuration's suffixes applied."""
    layout, flags = without_suffixes(config.removeprefix("epd-"), EPD_SUFFIXES)
    (door_process, gate, no_gate, traced, unbatched, fixed_chunks, placed, vllm_encoder, compiled,
     prefill_eager, decode_eager, eager) = (s in flags for s in EPD_SUFFIXES)  # fmt: skip
    env: dict[str, str] = {}
    in_flight = str(DECODE_SLOTS) if gate else "0" if no_gate else None
    service_args = {"router": ["--decode-in-flight", in_flight]} if in_flight is not None else {}
    if unbatched:
        service_args["pd"] = ["--prefill-batch-steps", "0"]
    if fixed_chunks:
        service_args["pd"] = [*service_args.get("pd", []), "--no-prefill-chunk-fair-share"]
    for role, role_eager in (("pd", eager), ("prefill", eager or prefill_eager), ("decode", eager or decode_eager)):
        if role_eager or compiled:
            mode = "--enforce-eager" if role_eager else "--no-enforce-eager"
            service_args[role] = [*service_args.get(role, []), mode]
    if traced:
        env |= {"EPD_TRACE_EXPORTER": "jsonl", "EPD_TRACE_FILE": str(run_dir / "spans.jsonl")}
    return StackSpec(layout=layout, encoders=1, model=model, run_dir=run_dir, engine="vllm",
                     encoder_engine="vllm" if vllm_encoder else "reference",
                     ready_timeout_s=ready_timeout_s, openai_door=True,
                     door_placement=DOOR_PROCESS_PLACEMENT if door_process else default_door_placement(layout),
                     env=env, placement=placed, extra_args=service_args)  # fmt: skip


@contextlib.contextmanager
def deployed(config: str, model: Path, run_dir: Path, engine: Engine, ready_timeout_s: float) -> Iterator[Deployment]:
    """Start one configuration, yield it ready, stop every process it started (by PID)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    name = model.name
    if config.startswith("epd-"):
        spec = epd_spec(config, model, run_dir, ready_timeout_s)
        vllm_encoder = spec.encoder_engine == "vllm"
        with Stack(spec).running() as stack:
            dep = Deployment(config, stack.door_url.removesuffix("/v1"), name, stack=stack,
                             note="vLLM encoder" if vllm_encoder else "reference encoder")  # fmt: skip
            wait_http(stack.door_url + "/models", [], ready_timeout_s)
            yield dep
        return
    storage = run_dir / "ec-storage"
    storage.mkdir(parents=True, exist_ok=True)
    procs: list[ServiceProcess] = []
    deployment, flags = without_suffixes(config, (ONE_PROCESS, PLACED, COMPILED))  # what runs; `config` names it
    one_process = ONE_PROCESS in flags
    plan = Placement.for_host() if PLACED in flags and deployment == "vllm-e+pd" else None

    def server(role: str, threads: int, extra: Sequence[str], env: dict[str, str] | None = None) -> str:
        port = free_port()
        if one_process:
            extra = [*extra, "--distributed-executor-backend", "uni"]
            env = {**(env or {}), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        cpus, nice = None, 0
        if plan is not None:  # the PD server's processes on the services' CPUs, its model worker alone
            cpus, nice = plan.cpus(role), plan.nice(role)
            if role == "pd":
                env = {**(env or {}), "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, sorted(plan.engine_cpus)))}
        eager = role == "encoder" or COMPILED not in flags
        proc = ServiceProcess(role, VLLM_CLI, serve_args(model, name, port, engine, extra, eager),
                              run_dir / f"{role}.log", cpus=cpus, nice=nice,
                              env={**VLLM_ENV, "OMP_NUM_THREADS": str(threads), **(env or {})})  # fmt: skip
        proc.start()
        procs.append(proc)
        return f"http://127.0.0.1:{port}"

    try:
        if deployment == UNSPLIT:
            url = server("unsplit", 2, [])
            wait_http(url + "/v1/models", procs, ready_timeout_s)
            yield Deployment(config, url, name, procs)
            return
        encoder = server("encoder", 1, ["--mm-encoder-only", "--no-enable-prefix-caching",
                                        "--ec-transfer-config", ec_config("ec_producer", storage)])  # fmt: skip
        prefill = ""
        if deployment == "vllm-e+pd":
            decode = server("pd", 1, ["--ec-transfer-config", ec_config("ec_consumer", storage)])
        else:
            prefill = server("prefill", 1,
                             ["--ec-transfer-config", ec_config("ec_consumer", storage),
                              "--kv-transfer-config", kv_config("kv_producer")],
                             {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())})  # fmt: skip
            decode = server("decode", 1, ["--kv-transfer-config", kv_config("kv_consumer")],
                            {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())})  # fmt: skip
        for url in (encoder, prefill, decode):
            if url:
                wait_http(url + "/v1/models", procs, ready_timeout_s)
        port = free_port()
        proxy_args = ["--port", str(port), "--encoder", encoder, "--decode", decode]
        if prefill:
            proxy_args += ["--prefill", prefill]
        proxy = ServiceProcess("proxy", "tests.benchmarks.peers.vllm_proxy", proxy_args, run_dir / "proxy.log",
                               cpus=None if plan is None else plan.cpus("router"))  # fmt: skip
        proxy.start()
        procs.append(proxy)
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/v1/models", procs, 60)
        yield Deployment(config, url, name, procs, note="proxy: tests/benchmarks/peers/vllm_proxy.py")
    finally:
        for proc in reversed(procs):
            proc.stop(timeout_s=20)


def bench_serve(
    argv: list[str], log: Path, timeout_s: float, cpus: frozenset[int] | None = None
) -> subprocess.CompletedProcess[str]:
    """vLLM's client in its own process (bounded in time; on `cpus` if given, else where the OS puts
    it), its output kept in `log`."""
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "PYTHONPATH": str(ROOT)}  # fmt: skip
    pin = None if cpus is None else functools.partial(os.sched_setaffinity, 0, cpus)
    out = subprocess.run([sys.executable, "-m", VLLM_CLI, *argv], capture_output=True, text=True,
                         cwd=ROOT, env=env, timeout=timeout_s, preexec_fn=pin)  # fmt: skip
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(out.stdout + "\n--- stderr ---\n" + out.stderr)
    return out


def load_average() -> tuple[float, float, float]:
    return os.getloadavg()


__all__ = [
    "ARRIVALS", "COMPILED", "CONFIGS", "DATASETS", "DECODE_EAGER", "DECODE_GATE", "DOOR_PROCESS", "EAGER", "METRICS",
    "NO_DECODE_GATE", "ONE_PROCESS", "PEERS", "PLACED", "PREFILL_EAGER", "TRACED", "UNSPLIT", "VLLM_ENCODER",
    "Dataset", "Deployment", "Engine", "Point", "Results",
    "arrivals", "bench_serve", "bench_serve_args", "deployed", "epd_spec", "median_range", "metrics_of", "plot",
    "points", "ratios", "schedule", "streamed_share", "streamed_tpot", "table", "wins", "without_suffixes",
]  # fmt: skip
