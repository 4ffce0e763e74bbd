"""The files and cross-file calls one image request passes through, per process and overall:

    python -m tests.benchmarks.callpath --layout e/p/d --engine reference --out FILE.json

Method (reproducible, independent of the package layout beyond "a project file"):
1. Start a real stack (`libs.launch.stack`) with every service run through
   `tests.benchmarks.callpath_probe`, a profile function on every Python thread (forked children, such
   as vLLM's EngineCore and Worker, inherit it).
2. Warm the stack with one image request (another image of the same size, so that the measured
   one hits no encoder cache), wait until every pool is empty, then switch recording on in every
   probed process (SIGUSR1), send ONE image request through the router (the test mix's image,
   greedy, `--tokens` tokens), switch recording off (SIGUSR2: each process writes its record),
   check the pools were already empty then (`settled_at_stop`; else `held_at_stop` names what
   was still held, and work that gave it back later is not in the record), stop the stack.
3. A project file is a `.py` file under `libs/` or `services/` of the repository (generated
   `*_pb2*` code and this tool excluded). A file is "entered" when one of its functions is called;
   a cross-file call edge is a (caller file, callee file, callee function) triple of a direct call
   (the callee's `f_back`) between two different project files; generators and coroutines count
   at their first entry, not at each resumption.
4. "Orchestration" is the files that match one of `--orchestration` patterns and none of
   `--not-orchestration` (fnmatch globs on the repository-relative path; defaults cover both the
   old and the new package names); an orchestration edge has both ends in it. Overall figures are
   the union over processes (a file entered by two processes counts once); per-process ones are
   that process's alone. `via` counts the triples seen only through a library frame
   (`callpath_probe`'s docstring), `calls` the calls along the direct edges.

Run to run, distinct edges differ by one or two where timing picks the path (a NIXL read that is
complete at its first poll makes no `TransferAgent.poll` call); call and entry counts vary more
(poll loops). The project's commit is recorded with the result; the tool's own files are never
counted, so a checkout that only adds them measures the commit below it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from tests.benchmarks.callpath_probe import ROOT

PROBE = "tests.benchmarks.callpath_probe"
ORCHESTRATION = (
    "services/*",
    "libs/serving/*",
    "libs/backends/*",
    "libs/engines/*",
    "libs/rpc/*",
    "libs/transfer/*",
    "libs/cache/*",
)
NOT_ORCHESTRATION = ("*/families/*", "*/media/*", "*/telemetry/*", "*/telemetry.py")
MEASURED_IMAGE = (40, 120, 1)  # the test mix "image" (tests/support/mixes.py)
WARM_IMAGE = (40, 120, 2)  # same size, other pixels: no cache hit for the measured one
PROMPT = "what is in this image"
SIGNAL_TIMEOUT_S = 60.0


# ---------------------------------------------------------------------------------------------
# Aggregation (pure: what tests/bench/test_callpath.py checks)


@dataclass(frozen=True)
class Edge:
    caller: str
    callee: str
    function: str
    calls: int = 1


@dataclass(frozen=True)
class Scope:
    """Which project files count as orchestration."""

    include: tuple[str, ...] = ORCHESTRATION
    exclude: tuple[str, ...] = NOT_ORCHESTRATION

    def covers(self, path: str) -> bool:
        return any(fnmatch(path, p) for p in self.include) and not any(fnmatch(path, p) for p in self.exclude)


def summarize(
    entered: Mapping[str, int], edges: Iterable[Edge], scope: Scope | None = None, via: Iterable[Edge] = ()
) -> dict[str, int]:
    """Counts over files entered and edges; with `scope`, only files it covers and edges with both
    ends in it. `edges` are distinct direct triples, `file_pairs` distinct (caller, callee) files,
    `calls` the calls along them, `entries` the function entries into the files; `via_edges` the
    distinct triples seen only through a library frame (not also as direct calls)."""
    covers: Callable[[str], bool] = scope.covers if scope is not None else lambda _: True
    files = {f for f in entered if covers(f)}
    kept = [e for e in edges if covers(e.caller) and covers(e.callee)]
    direct = {(e.caller, e.callee, e.function) for e in kept}
    through = {(e.caller, e.callee, e.function) for e in via if covers(e.caller) and covers(e.callee)}
    return {
        "files": len(files),
        "edges": len(direct),
        "file_pairs": len({(e.caller, e.callee) for e in kept}),
        "calls": sum(e.calls for e in kept),
        "entries": sum(entered[f] for f in files),
        "via_edges": len(through - direct),
    }


def merge(records: Iterable[tuple[Mapping[str, int], Iterable[Edge]]]) -> tuple[dict[str, int], list[Edge]]:
    """The union of several processes' records: entries and calls summed per file and per triple."""
    entered: dict[str, int] = {}
    calls: dict[tuple[str, str, str], int] = {}
    for files, edges in records:
        for path, n in files.items():
            entered[path] = entered.get(path, 0) + n
        for e in edges:
            key = (e.caller, e.callee, e.function)
            calls[key] = calls.get(key, 0) + e.calls
    return entered, [Edge(*key, calls=n) for key, n in sorted(calls.items())]


def top_files(entered: Mapping[str, int], edges: Sequence[Edge], limit: int | None = 12) -> list[dict[str, Any]]:
    """Files by the cross-file calls into them: calls, distinct functions called from other files,
    distinct files calling them, function entries of any caller."""
    rows: list[dict[str, Any]] = []
    for path in entered:
        into = [e for e in edges if e.callee == path]
        out = [e for e in edges if e.caller == path]
        rows.append(
            {
                "file": path,
                "calls_in": sum(e.calls for e in into),
                "functions_in": len({e.function for e in into}),
                "callers": len({e.caller for e in into}),
                "edges_out": len({(e.callee, e.function) for e in out}),
                "entries": entered[path],
            }
        )
    rows.sort(key=lambda r: (-r["calls_in"], -r["entries"], r["file"]))
    return rows[:limit]


def edges_of(record: Mapping[str, Any], kind: str = "edges") -> list[Edge]:
    """A record's direct edges (`kind` "edges") or those through a library frame ("via")."""
    return [Edge(caller, callee, function, calls) for caller, callee, function, calls in record.get(kind, [])]


def label_processes(records: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """A name per probed process: the service's, and `service/comm` for a forked child."""
    by_pid = {r["pid"]: r for r in records}
    labels: dict[str, Mapping[str, Any]] = {}
    for r in sorted(records, key=lambda r: (r["name"], r["pid"])):
        label = r["name"]
        if r["ppid"] in by_pid:  # a child of another probed process
            label = f"{r['name']}/{r['comm'] or r['pid']}"
        while label in labels:
            label += "'"
        labels[label] = r
    return labels


def report(records: Sequence[Mapping[str, Any]], scope: Scope) -> dict[str, Any]:
    """Per process and overall counts (all project files, orchestration), and the top files."""
    labelled = label_processes(records)
    processes = {
        label: {
            "all": summarize(r["entered"], edges_of(r), via=edges_of(r, "via")),
            "orchestration": summarize(r["entered"], edges_of(r), scope, edges_of(r, "via")),
            "threads": r.get("threads", {}),
            "files": top_files(r["entered"], edges_of(r), limit=None),
            "edges": r["edges"],
            "via": r.get("via", []),
        }
        for label, r in labelled.items()
    }
    entered, edges = merge((r["entered"], edges_of(r)) for r in records)
    _, via = merge(({}, edges_of(r, "via")) for r in records)
    orchestration_files = {f: n for f, n in entered.items() if scope.covers(f)}
    return {
        "processes": processes,
        "overall": {
            "all": summarize(entered, edges, via=via),
            "orchestration": summarize(entered, edges, scope, via),
        },
        "top_files": top_files(entered, edges),
        "orchestration_files": sorted(orchestration_files),
        "files": sorted(entered),
        "edges": [[e.caller, e.callee, e.function, e.calls] for e in edges],
        "via": [[e.caller, e.callee, e.function, e.calls] for e in via],
    }


def table(result: Mapping[str, Any]) -> str:
    """The counts as a short text table."""
    cols = f"{'edges':>5} {'pairs':>5} {'calls':>6} {'via':>4}"
    head = f"{'process':<24} {'files':>5} {cols} | {'orch files':>10} {cols}"
    lines = [head, "-" * len(head)]
    rows = [*result["processes"].items(), ("overall (union)", result["overall"])]
    for label, counts in rows:
        a, o = counts["all"], counts["orchestration"]
        lines.append(
            f"{label:<24} {a['files']:>5} {a['edges']:>5} {a['file_pairs']:>5} {a['calls']:>6} {a['via_edges']:>4} | "
            f"{o['files']:>10} {o['edges']:>5} {o['file_pairs']:>5} {o['calls']:>6} {o['via_edges']:>4}"
        )
    lines += ["", f"{'top files by cross-file calls in':<48} {'calls':>6} {'funcs':>5} {'callers':>7} {'entries':>7}"]
    for row in result["top_files"]:
        lines.append(
            f"{row['file']:<48} {row['calls_in']:>6} {row['functions_in']:>5} {row['callers']:>7} {row['entries']:>7}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The run through a real stack


def _png(width: int, height: int, seed: int) -> bytes:
    from libs.model.media.synthetic import png_bytes

    return png_bytes(width, height, seed=seed)


def _request(image: bytes, tokens: int, request_id: str) -> Any:
    from libs.contract.epd.v1 import chat_pb2, generate_pb2, media_pb2, sampling_pb2

    parts = [
        chat_pb2.ContentPart(text=PROMPT),
        chat_pb2.ContentPart(media=media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=image)),
    ]
    return generate_pb2.GenerateRequest(
        request_id=request_id,
        messages=[chat_pb2.ChatMessage(role=chat_pb2.CHAT_ROLE_USER, parts=parts)],
        sampling=sampling_pb2.SamplingParams(max_tokens=tokens),  # temperature 0: greedy
    )


def _generate(address: str, request: Any) -> Any:
    from libs.client.generate import generate, open_channel

    async def go() -> Any:
        async with open_channel(address) as channel:
            return await generate(channel, request, timeout_s=600.0)

    return asyncio.run(go())


def _held(address: str) -> dict[str, int]:
    """What a model service holds (`GetStats`): slots, leases, requests, sequences; nonzero only."""
    import grpc

    from libs.contract.epd.v1 import stats_pb2, stats_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        s = stats_pb2_grpc.StatsServiceStub(channel).GetStats(stats_pb2.GetStatsRequest(), timeout=10)
    held = {
        "slots_in_use": s.pool.slots_in_use,
        "active_leases": s.pool.active_leases,
        "requests_in_flight": s.requests_in_flight,
        "active_sequences": s.active_sequences,
    }
    return {k: int(v) for k, v in held.items() if v}


def _wait(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.02)


def _probed(probe_dir: Path) -> list[int]:
    """PIDs of live processes that carry the recorder."""
    pids = []
    for ready in probe_dir.glob("*.ready"):
        pid = int(ready.name.rsplit(".", 2)[1])
        if Path(f"/proc/{pid}").exists():
            pids.append(pid)
    return sorted(pids)


def _signal_all(pids: Sequence[int], signum: int, probe_dir: Path, suffix: str) -> None:
    for pid in pids:
        os.kill(pid, signum)
    _wait(
        lambda: all(any(probe_dir.glob(f"*.{pid}.{suffix}")) for pid in pids),
        SIGNAL_TIMEOUT_S,
        f"every probed process's .{suffix} file",
    )


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return ""
    return out.stdout.strip()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from libs.launch.stack import Stack, StackSpec, replica_names

    slug = f"{args.layout.replace('/', '-').replace('+', '-')}-{args.engine}"
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix=f"epd-callpath-{slug}-"))
    print(f"services' logs and records in {run_dir}", flush=True)
    probe_dir = (run_dir / "probe").resolve()
    shutil.rmtree(probe_dir, ignore_errors=True)
    probe_dir.mkdir(parents=True)
    names = [f"encoder-{i}" for i in range(args.encoders)] + ["router"]
    names += [*replica_names("prefill", 1), *replica_names("decode", 1)] if args.layout == "e/p/d" else ["pd"]
    spec = StackSpec(
        layout=args.layout,
        encoders=args.encoders,
        model=Path(args.model),
        run_dir=run_dir,
        engine=args.engine,
        run_through={n: [PROBE, "--name", n, "--out", str(probe_dir)] for n in names},
        ready_timeout_s=args.ready_timeout_s,
    )
    stack = Stack(spec)
    with stack.running():
        services = {n: p.address for n, p in stack.processes.items() if n != "router"}

        def holding() -> dict[str, dict[str, int]]:
            return {n: held for n, a in services.items() if (held := _held(a))}

        def idle() -> bool:
            return not holding()

        warm = _generate(stack.address, _request(_png(*WARM_IMAGE), args.tokens, "callpath-warm"))
        _wait(idle, 120.0, "every pool empty after the warm-up request")
        pids = _probed(probe_dir)
        _signal_all(pids, signal.SIGUSR1, probe_dir, "on")
        measured = _generate(stack.address, _request(_png(*MEASURED_IMAGE), args.tokens, "callpath-measured"))
        _signal_all(pids, signal.SIGUSR2, probe_dir, "json")
        held_at_stop = holding()
    records = [json.loads(p.read_text()) for p in sorted(probe_dir.glob("*.json"))]
    scope = Scope(tuple(args.orchestration or ORCHESTRATION), tuple(args.not_orchestration or NOT_ORCHESTRATION))
    return {
        "layout": args.layout,
        "engine": args.engine,
        "commit": _commit(),
        "python": sys.version.split()[0],
        "request": {
            "image": {"width": MEASURED_IMAGE[0], "height": MEASURED_IMAGE[1], "seed": MEASURED_IMAGE[2]},
            "prompt": PROMPT,
            "max_tokens": args.tokens,
            "tokens": list(measured.token_ids),
            "warm_tokens": list(warm.token_ids),
        },
        # Whether the services had given back everything once recording stopped: if not, some of
        # the request's tail (lease and KV releases) may have run after the record was written.
        "settled_at_stop": not held_at_stop,
        "held_at_stop": held_at_stop,
        "scope": {"orchestration": list(scope.include), "not_orchestration": list(scope.exclude)},
        **report(records, scope),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.callpath", description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", default="e/p/d", choices=("e/p/d", "e+pd"))
    parser.add_argument("--engine", default="reference", choices=("reference", "vllm"))
    parser.add_argument("--out", type=Path, required=True, help="JSON result")
    parser.add_argument("--encoders", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--model", default="var/models/qwen2_5_omni-tiny")
    parser.add_argument("--run-dir", default="", help="logs and records (default: a new temporary folder)")
    parser.add_argument("--ready-timeout-s", type=float, default=600.0)
    parser.add_argument("--orchestration", action="append", metavar="GLOB", help=f"default: {' '.join(ORCHESTRATION)}")
    parser.add_argument(
        "--not-orchestration", action="append", metavar="GLOB", help=f"default: {' '.join(NOT_ORCHESTRATION)}"
    )
    args = parser.parse_args(argv)
    result = measure(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{args.layout} on {args.engine} at {result['commit'][:7]}: settled at stop: {result['settled_at_stop']}")
    print(table(result))


if __name__ == "__main__":
    main()
