"""`epd bench` as a user runs it, against an in-process gRPC server that answers as a router does
(its ServiceInfo, a streamed Generate) or fails every request: it says what it does while it
prepares and runs, why the run ended (the request count or the duration, whichever came first:
no hidden count cuts a duration short), prints goodput only against an SLO it was given, prints
the first error and exits 1 when requests fail or the router cannot be reached, and writes each
run to a file of its own unless --out names one."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from libs.cli.main import main
from libs.contract.epd.v1 import (
    generate_pb2,
    generate_pb2_grpc,
    generation_pb2,
    service_info_pb2,
    service_info_pb2_grpc,
)

pytestmark = pytest.mark.unit


class _Router(generate_pb2_grpc.GenerateServiceServicer, service_info_pb2_grpc.ServiceInfoServiceServicer):
    def __init__(self, fail: grpc.StatusCode | None) -> None:
        self.fail = fail

    def GetServiceInfo(self, request: Any, context: Any) -> service_info_pb2.GetServiceInfoResponse:
        return service_info_pb2.GetServiceInfoResponse(
            info=service_info_pb2.ServiceInfo(role=service_info_pb2.SERVICE_ROLE_ROUTER)
        )

    def Generate(self, request: Any, context: Any) -> Iterator[generate_pb2.GenerateResponse]:
        if self.fail is not None:
            context.abort(self.fail, "the router is full")
        for token in range(3):
            chunk = generation_pb2.TokenChunk(token_ids=[token], text="x")
            if token == 2:
                chunk.finish_reason = generation_pb2.FINISH_REASON_LENGTH
            yield generate_pb2.GenerateResponse(request_id=request.request_id, chunk=chunk)


def _serve(fail: grpc.StatusCode | None) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    router = _Router(fail)
    generate_pb2_grpc.add_GenerateServiceServicer_to_server(router, server)
    service_info_pb2_grpc.add_ServiceInfoServiceServicer_to_server(router, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
def router() -> Iterator[str]:
    server, address = _serve(None)
    yield address
    server.stop(None)


def _bench(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as done:
        main(["bench", *args])
    out, err = capsys.readouterr()
    return int(done.value.code or 0), out, err


def test_a_request_count_run_says_it_ended_there_and_writes_a_file_per_run(
    router: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    args = ["--address", router, "--mix", "text=1,max_tokens=3", "--requests", "5", "--warmup", "1"]
    code, out, err = _bench(args, capsys)
    assert code == 0, err
    assert "building 6 requests (100% text; up to 3 output tokens each)" in err  # preparation, said
    assert "built 6/6 requests" in err
    assert "5 requests (0 failed)" in out and "ended: all 5 --requests answered" in out
    assert "goodput" not in out  # no SLO was given: it would only repeat the throughput
    first = Path(re.search(r"-> (\S+)$", out.strip()).group(1))  # type: ignore[union-attr]
    assert first.parent == Path("var/bench") and first.name.startswith("bench-")
    result = json.loads(first.read_text())
    assert result["ended_by"] == "requests" and result["slo"] is None
    assert "goodput_rps" not in result["overall"]

    code, out, _ = _bench([*args, "--slo-ttft", "5"], capsys)
    assert code == 0 and "goodput" in out and "within the SLO" in out
    second = Path(re.search(r"-> (\S+)$", out.strip()).group(1))  # type: ignore[union-attr]
    assert second != first and first.exists()  # a run never overwrites another's results


def test_a_duration_run_is_not_cut_short_by_a_hidden_count(
    router: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / "run.json"
    args = ["--address", router, "--mix", "text=1,max_tokens=3", "--closed", "2", "--duration", "1"]
    code, out, err = _bench([*args, "--warmup", "0", "--out", str(out_file)], capsys)
    assert code == 0, err
    assert "building requests while the run goes" in err and "until 1 s" in err
    assert "ended: --duration 1 s reached" in out and out.strip().endswith(f"-> {out_file}")
    result = json.loads(out_file.read_text())
    assert result["ended_by"] == "duration" and result["config"]["max_requests"] is None
    assert result["overall"]["count"] > 0


def test_failed_requests_print_the_first_error_and_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    server, address = _serve(grpc.StatusCode.RESOURCE_EXHAUSTED)
    try:
        args = ["--address", address, "--mix", "text=1", "--requests", "3", "--warmup", "0"]
        code, out, err = _bench([*args, "--out", str(tmp_path / "r.json")], capsys)
    finally:
        server.stop(None)
    assert code == 1
    assert "3 requests (3 failed)" in out and "nan" not in out
    assert "3 of 3 requests failed; the first: RESOURCE_EXHAUSTED: the router is full" in err


def test_an_unreachable_router_is_said_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _bench(["--requests", "2", "--address", "127.0.0.1:1", "--out", str(tmp_path / "r.json")], capsys)
    assert code == 1 and out == ""
    assert "cannot reach the router at 127.0.0.1:1" in err and "connection refused" in err
    assert "building" not in err  # no media built for a router that is not there
    assert not (tmp_path / "r.json").exists()
