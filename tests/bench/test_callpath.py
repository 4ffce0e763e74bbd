"""The call-path tool's counting without a stack: triples in, files / edges / orchestration out, and
the probe's view of what a project file is and of a direct cross-file call."""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.benchmarks.callpath import Edge, Scope, label_processes, merge, report, summarize, table, top_files
from tests.benchmarks.callpath_probe import ROOT, Recorder, project_file

pytestmark = pytest.mark.unit

ROUTER = "services/router/core.py"
RPC = "libs/rpc/peers.py"
SERVING = "libs/serving/convert.py"
FAMILY = "libs/engine/families/qwen2_5_omni.py"
NEW_FAMILY = "libs/model/families/qwen2_5_omni.py"
TELEMETRY = "libs/telemetry/stages.py"


def record(name: str, pid: int, ppid: int, entered: dict[str, int], edges: list[Edge], comm: str = "python") -> Any:
    return {
        "name": name,
        "pid": pid,
        "ppid": ppid,
        "comm": comm,
        "entered": entered,
        "edges": [[e.caller, e.callee, e.function, e.calls] for e in edges],
    }


def test_summarize_counts_distinct_triples_file_pairs_and_calls() -> None:
    entered = {ROUTER: 5, RPC: 3, SERVING: 2, FAMILY: 4}
    edges = [
        Edge(ROUTER, RPC, "PeerDirectory.channel", 2),
        Edge(ROUTER, RPC, "PeerDirectory.check", 1),  # same pair, another function
        Edge(ROUTER, SERVING, "to_wire", 1),
        Edge(SERVING, FAMILY, "Family.layout", 3),
    ]
    assert summarize(entered, edges) == {
        "files": 4,
        "edges": 4,
        "file_pairs": 3,
        "calls": 7,
        "entries": 14,
        "via_edges": 0,
    }


def test_orchestration_keeps_edges_with_both_ends_in_scope_on_old_and_new_names() -> None:
    entered = {ROUTER: 1, RPC: 1, SERVING: 1, FAMILY: 1, NEW_FAMILY: 1, TELEMETRY: 1, "libs/backends/vllm/pd.py": 1}
    edges = [
        Edge(ROUTER, RPC, "f"),
        Edge(SERVING, FAMILY, "g"),  # model code: not orchestration
        Edge(SERVING, NEW_FAMILY, "g"),  # ... under its new name too
        Edge(ROUTER, TELEMETRY, "span"),  # telemetry: not orchestration
        Edge("libs/backends/vllm/pd.py", SERVING, "h"),  # the new adapters' package is
    ]
    counts = summarize(entered, edges, Scope())
    assert counts["files"] == 4  # router, rpc, serving, backends
    assert counts["edges"] == 2
    narrow = summarize(entered, edges, Scope(include=("services/*",)))
    assert (narrow["files"], narrow["edges"]) == (1, 0)


def test_via_edges_count_only_triples_not_also_seen_directly() -> None:
    direct = [Edge(ROUTER, RPC, "f")]
    via = [Edge(ROUTER, RPC, "f"), Edge(ROUTER, SERVING, "cm")]
    assert summarize({ROUTER: 1, RPC: 1, SERVING: 1}, direct, via=via)["via_edges"] == 1


def test_overall_is_the_union_over_processes() -> None:
    router = record("router", 10, 1, {ROUTER: 2, RPC: 1}, [Edge(ROUTER, RPC, "f", 2)])
    prefill = record("prefill", 11, 1, {SERVING: 1, RPC: 4}, [Edge(SERVING, RPC, "f"), Edge(SERVING, FAMILY, "g")])
    core = record("prefill", 12, 11, {RPC: 1}, [Edge(ROUTER, RPC, "f", 3)], comm="VLLM::EngineCore")
    entered, edges = merge((r["entered"], [Edge(*e) for e in r["edges"]]) for r in (router, prefill, core))
    assert entered == {ROUTER: 2, RPC: 6, SERVING: 1}
    assert Edge(ROUTER, RPC, "f", 5) in edges and len(edges) == 3

    result = report([router, prefill, core], Scope())
    assert set(result["processes"]) == {"router", "prefill", "prefill/VLLM::EngineCore"}
    assert result["processes"]["prefill"]["all"]["edges"] == 2
    assert result["processes"]["prefill"]["orchestration"]["edges"] == 1
    assert result["overall"]["all"] == {
        "files": 3,
        "edges": 3,
        "file_pairs": 3,
        "calls": 7,
        "entries": 9,
        "via_edges": 0,
    }
    assert result["overall"]["orchestration"]["edges"] == 2
    assert result["top_files"][0] == {
        "file": RPC,
        "calls_in": 6,
        "functions_in": 1,
        "callers": 2,
        "edges_out": 0,
        "entries": 6,
    }
    assert "overall (union)" in table(result)


def test_labels_tell_children_and_same_named_processes_apart() -> None:
    records = [record("pd", 1, 0, {}, []), record("pd", 2, 1, {}, [], "W"), record("pd", 3, 1, {}, [], "W")]
    assert list(label_processes(records)) == ["pd", "pd/W", "pd/W'"]


def test_top_files_rank_by_calls_in() -> None:
    entered = {ROUTER: 9, RPC: 1, SERVING: 1}
    edges = [Edge(ROUTER, RPC, "a"), Edge(ROUTER, SERVING, "b", 4), Edge(ROUTER, SERVING, "c")]
    assert [r["file"] for r in top_files(entered, edges)] == [SERVING, RPC, ROUTER]
    assert top_files(entered, edges)[0]["functions_in"] == 2


def test_project_file_is_under_libs_or_services_and_not_generated() -> None:
    assert project_file(str(ROOT / "libs/rpc/peers.py")) == "libs/rpc/peers.py"
    assert project_file(str(ROOT / "services/router/core.py")) == "services/router/core.py"
    assert project_file(str(ROOT / "libs/contract/epd/v1/generate_pb2.py")) == ""
    assert project_file(str(ROOT / "libs/contract/epd/v1/generate_pb2_grpc.py")) == ""
    assert project_file(str(ROOT / "tests/support/stacks.py")) == ""
    assert project_file(str(ROOT / "tests/benchmarks/callpath_probe.py")) == ""  # the tool itself
    assert project_file(os.__file__) == ""
    assert project_file("<frozen importlib._bootstrap>") == ""


A = """
from libs import b

def calls_b():
    b.plain()
    list(b.numbers())  # list() is C: no frame of its own, the caller is still this one
    for _ in b.numbers():  # entered once from here, resumed twice more
        pass
    with b.held():  # entered from contextlib's __enter__: a call through a library frame
        pass
    return b.plain()
"""
B = """
import contextlib

@contextlib.contextmanager
def held():
    yield

def plain():
    return helper()

def helper():
    return 1

def numbers():
    yield 1
    yield 2
"""


def _load(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_the_recorder_counts_direct_cross_file_calls_and_first_entries_only_while_on(tmp_path: Path) -> None:
    (tmp_path / "libs").mkdir()
    (tmp_path / "libs/a.py").write_text(A)
    (tmp_path / "libs/b.py").write_text(B)
    b = _load(tmp_path / "libs/b.py", "libs.b")
    try:
        a = _load(tmp_path / "libs/a.py", "callpath_test_a")
        recorder = Recorder("unit", tmp_path / "out", root=tmp_path)
        recorder.announce()
        previous = sys.getprofile()
        sys.setprofile(recorder.profile)
        try:
            a.calls_b()  # off: not recorded
            recorder.start()
            a.calls_b()
            recorder.on = False
            a.calls_b()
        finally:
            sys.setprofile(previous)
    finally:
        del sys.modules["libs.b"], sys.modules["callpath_test_a"]
    assert b.plain() == 1
    result = recorder.result()
    # a.calls_b once; b: plain twice (+ helper each), numbers twice (first entries only), held
    assert result["entered"] == {"libs/a.py": 1, "libs/b.py": 7}
    assert result["edges"] == [["libs/a.py", "libs/b.py", "numbers", 2], ["libs/a.py", "libs/b.py", "plain", 2]]
    assert result["via"] == [["libs/a.py", "libs/b.py", "held", 1]]
    assert (tmp_path / "out" / f"unit.{os.getpid()}.on").exists()
    assert (tmp_path / "out" / f"unit.{os.getpid()}.ready").exists()


def test_sigusr2_writes_the_record(tmp_path: Path) -> None:
    recorder = Recorder("sig", tmp_path)
    previous = signal.getsignal(signal.SIGUSR2)
    signal.signal(signal.SIGUSR2, recorder.stop)
    try:
        os.kill(os.getpid(), signal.SIGUSR2)
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert (tmp_path / f"sig.{os.getpid()}.json").exists()
