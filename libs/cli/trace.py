"""`epd trace report`: the time to first token of a run's requests split by stage, and one
request's waterfall.

By default it reports the latest run of the stack in `--run-dir` (libs/launch/runs.py: each
`epd up` writes its spans to a file of its own), so requests of earlier runs, benchmarks and other
stacks do not mix into its percentiles; `--run ID` picks an earlier run, `--all` takes every run,
`--file` any span file whole, `--otlp-listen` collects spans itself. Requests are named by the id
`epd generate` and the OpenAI door print (`--request`, `--waterfall`).

Services write a span within `EXPORT_DELAY_S` of its end (libs/telemetry/tracing.py). Against a
running stack the report says so and waits that long, a few times over, before reading: requests
that finished before it ran are in it; requests still running are not.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from libs.cli.router_client import DEFAULT_RUN_DIR
from libs.launch import runs
from libs.telemetry.report import RequestBreakdown, breakdowns, matching, render_text
from libs.telemetry.spans import OtlpReceiver, SpanRecord, by_trace, load_jsonl
from libs.telemetry.tracing import EXPORT_DELAY_S

# How long the report waits for spans still on their way to the file of a running stack: a few of
# the services' export delays, for a loaded host's threads to get their turn.
SETTLE_S = 4 * EXPORT_DELAY_S
# How long it keeps looking for one request asked for by id (`--request`, `--waterfall ID`) in a
# running stack's spans before it says the request is not there.
FIND_S = 10.0


class ReportError(Exception):
    """Nothing to report from what the command line names (exit status 2)."""


@dataclass
class Source:
    """Where the spans come from, and which of their requests belong to the report."""

    describe: str
    load: list[Path]
    window: tuple[int, int | None] = (0, None)
    live: bool = False

    def spans(self) -> list[SpanRecord]:
        return [span for path in self.load if path.exists() for span in load_jsonl(path)]

    def requests(self, spans: list[SpanRecord]) -> list[RequestBreakdown]:
        start, end = self.window
        return [b for b in breakdowns(spans) if b.start_ns >= start and (end is None or b.start_ns < end)]


def _run_source(ns: argparse.Namespace) -> Source:
    every = runs.every(ns.run_dir)
    if not every:
        raise ReportError(
            f"no runs in {ns.run_dir} (start a stack with `epd up`, give the --run-dir of the one you ran, "
            "or --file SPANS.jsonl)"
        )
    if ns.all:
        files = list(dict.fromkeys(r.trace_file for r in every if r.trace_file is not None))
        live = any(runs.live(ns.run_dir, r) for r in every)
        return Source(f"every run of {ns.run_dir} ({len(every)})", files, live=live)
    if ns.run:
        chosen = [r for r in every if r.id == ns.run]
        if not chosen:
            ids = ", ".join(r.id for r in every[-5:])
            raise ReportError(f"no run {ns.run} in {ns.run_dir}; its latest: {ids}")
        run = chosen[0]
    else:
        run = runs.latest(ns.run_dir) or every[-1]
    if run.trace_file is None:
        raise ReportError(
            f"run {run.id} of {ns.run_dir} wrote no span file (its services exported spans elsewhere, or none: "
            "--trace-exporter); --otlp-listen collects spans from a running stack"
        )
    live = runs.live(ns.run_dir, run)
    state = "running" if live else "stopped"
    others = " (--run ID or --all for the others)" if len(every) > 1 else ""
    describe = f"run {run.id} of {ns.run_dir} ({state}), spans in {runs.shown(run.trace_file)}{others}"
    return Source(describe, [run.trace_file], runs.window(run, every), live)


def _source(ns: argparse.Namespace) -> Source:
    if ns.file is not None:
        if not ns.file.exists():
            raise ReportError(f"no span file at {ns.file}")
        return Source(f"every request in {ns.file}", [ns.file])
    return _run_source(ns)


def _collect(ns: argparse.Namespace) -> list[SpanRecord]:
    receiver = OtlpReceiver(ns.otlp_listen).start()
    print(f"OTLP/gRPC receiver on {receiver.address}; collecting for {ns.duration:.0f} s (Ctrl-C ends early)")
    with contextlib.suppress(KeyboardInterrupt):
        threading.Event().wait(ns.duration)
    receiver.stop()
    return receiver.snapshot()


def _wanted(ns: argparse.Namespace) -> str:
    """The id of one request the command asks for, if any."""
    if ns.request:
        return str(ns.request)
    return "" if ns.waterfall in ("", "first", "slowest") else str(ns.waterfall)


def _read(ns: argparse.Namespace, source: Source) -> tuple[list[SpanRecord], list[RequestBreakdown]]:
    """The spans and the requests of `source`; against a running stack, after its spans settled
    (and, for one request asked for by id, once it is there or FIND_S has passed)."""
    if source.live:
        print(
            f"the stack is running: waiting {SETTLE_S:.1f} s for spans on their way (services write a span "
            f"within {EXPORT_DELAY_S:.2f} s of its end); requests still running are not reported",
            file=sys.stderr,
        )
        time.sleep(SETTLE_S)
    spans = source.spans()
    items = source.requests(spans)
    wanted = _wanted(ns)
    deadline = time.monotonic() + FIND_S
    while source.live and wanted and not _named(items, spans, wanted) and time.monotonic() < deadline:
        time.sleep(EXPORT_DELAY_S)
        spans = source.spans()
        items = source.requests(spans)
    return spans, items


def _named(items: list[RequestBreakdown], spans: list[SpanRecord], ident: str) -> str | None:
    """The trace id `ident` names: a request's (see `matching`), else a trace's own id."""
    found = matching(items, ident)
    if found:
        return found[0].trace_id
    return ident if any(s.trace_id == ident for s in spans) else None


def cmd_trace_report(ns: argparse.Namespace) -> int:
    from libs.telemetry.waterfall import render

    if ns.otlp_listen:
        source = Source(f"spans sent to {ns.otlp_listen}", [])
        spans = _collect(ns)
        items = breakdowns(spans)
    else:
        try:
            source = _source(ns)
        except ReportError as exc:
            print(f"epd trace report: {exc}", file=sys.stderr)
            return 2
        spans, items = _read(ns, source)
    print(f"traces of {source.describe}")
    if ns.request:
        items = matching(items, ns.request)
        if not items:
            print(f"epd trace report: no request {ns.request} in {source.describe}", file=sys.stderr)
            return 1
    print(render_text(items), end="")
    if not ns.waterfall:
        return 0
    if ns.waterfall in ("first", "slowest"):
        if not items:
            print("epd trace report: no request trace to draw", file=sys.stderr)
            return 1
        trace_id: str | None = (items[0] if ns.waterfall == "first" else max(items, key=lambda b: b.ttft_s)).trace_id
    else:
        trace_id = _named(items, spans, ns.waterfall)
    traces = by_trace(spans)
    if trace_id is None or trace_id not in traces:
        print(f"epd trace report: no request or trace {ns.waterfall} in {source.describe}", file=sys.stderr)
        return 1
    out = ns.out or _default_out(ns, source)
    out.parent.mkdir(parents=True, exist_ok=True)
    render(traces[trace_id], out)
    named = next((b.request_id for b in items if b.trace_id == trace_id and b.request_id), "")
    print(f"waterfall of {f'request {named}, ' if named else ''}trace {trace_id}: {out}")
    return 0


def _default_out(ns: argparse.Namespace, source: Source) -> Path:
    """Beside the spans it is drawn from: the run's directory, the --file's; else in RUN_DIR."""
    if len(source.load) == 1:
        return runs.shown(source.load[0].parent / "waterfall.html")
    return Path(ns.run_dir) / "waterfall.html"


def add_parser(trace: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    report = trace.add_parser(
        "report",
        help="split time to first token by stage, per request and p50/p90/p99",
        description="The time to first token of the latest run's requests (RUN_DIR/latest/spans.jsonl) split by "
        f"stage. Services write a span within {EXPORT_DELAY_S} s of its end; against a running stack the report "
        f"waits {SETTLE_S} s first, so requests that finished before it ran are in it.",
    )
    report.add_argument(
        "--run-dir", type=Path, default=DEFAULT_RUN_DIR, help="the stack whose runs to report (what `epd up` ran in)"
    )
    report.add_argument(
        "--run", default="", help="one run of it by id (RUN_DIR/runs/ID; unset: the latest, RUN_DIR/latest)"
    )
    report.add_argument("--all", action="store_true", help="every run of RUN_DIR, not only the latest")
    report.add_argument(
        "--file", type=Path, default=None, help="instead: every request of this JSONL span file (unset: the run's)"
    )
    report.add_argument("--otlp-listen", default="", help="instead: run an OTLP/gRPC receiver on HOST:PORT")
    report.add_argument("--duration", type=float, default=60.0, help="seconds the receiver collects")
    report.add_argument(
        "--request",
        default="",
        help="only this request: the id `epd generate` prints, the OpenAI door's response id, or a trace id",
    )
    report.add_argument(
        "--waterfall",
        default="",
        help="draw one request: its id (as --request takes), 'first' or 'slowest'",
    )
    report.add_argument(
        "--out",
        type=Path,
        default=None,
        help=".html or .png (unset: waterfall.html beside the spans: in the run's directory, or the --file's)",
    )
    report.set_defaults(func=cmd_trace_report)
