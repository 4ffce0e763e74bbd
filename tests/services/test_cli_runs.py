"""Each `epd up` run apart from the others, as a user meets it (the installed `epd` script; two runs
of an E+PD stack with the Mooncake Store, one after the other, in one run directory):

- `epd trace report` run right after `epd generate`, while the stack runs, reports that request
  whole (the PD service's stages too, not only the router's span), and says it waited for spans
  on their way;
- the ids users are shown name requests: `--waterfall` takes the id `epd generate` prints and the
  OpenAI door's response id;
- after a second run, the report shows that run's requests only, `--run ID` the first's, `--all`
  both;
- every `*.log` of a run is JSON lines, each line of it (what `jq` needs); the native output of
  the processes (Mooncake's glog in the encoder and the router) is kept beside, in `*.native.log`.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import urllib.request
from pathlib import Path

import pytest

from libs.launch import runs
from tests.support.epd_cli import EPD, Lines, cli_env, parse_table, run_epd

pytestmark = [pytest.mark.stack, pytest.mark.slow]


def _report(args: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess[str], dict[str, list[str]], list[str]]:
    done = run_epd(["trace", "report", *args], cwd, 120)
    assert done.returncode == 0, done.stdout + done.stderr
    columns, rows = parse_table(done.stdout, "request ")
    return done, {k: v for k, v in rows.items() if not k.startswith("p")}, columns


def _generate(run_dir: Path, cwd: Path) -> str:
    done = run_epd(["generate", "Hello", "--run-dir", str(run_dir), "--max-tokens", "4"], cwd, 120)
    assert done.returncode == 0, done.stderr
    match = re.search(r"^\[(\S+)\] 4 tokens", done.stderr, re.MULTILINE)
    assert match, done.stderr
    return match.group(1)


class _Up:
    """One `epd up` run, stopped with Ctrl-C."""

    def __init__(self, model: Path, run_dir: Path, cwd: Path) -> None:
        args = ["up", "--layout", "e+pd", "--encoders", "1", "--cache-store", "--model", str(model)]
        args += ["--run-dir", str(run_dir), "--no-supervise"]
        self.process = subprocess.Popen(
            [EPD, *args], cwd=cwd, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines = Lines(self.process)
        self.logs = Path(self.lines.until(r"^logs of this run: (\S+)/<service>\.log", 300).group(1))
        self.spans = Path(self.lines.until(r"^spans of this run: (\S+) ", 10).group(1))
        self.door = self.lines.until(r"base_url=(http://\S+/v1)$", 60).group(1)
        self.lines.until(r"^Ctrl-C stops the stack\.$", 60)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        out = self.lines.rest(180)
        self.process.wait(60)
        assert self.process.returncode == 0, out


def _door_id(base_url: str, model: str) -> str:
    body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    request = urllib.request.Request(
        f"{base_url}/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        return str(json.loads(reply.read())["id"])


@pytest.mark.timeout(900)
def test_each_run_has_its_own_traces_and_json_logs(model_path: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = _Up(model_path, run_dir, tmp_path)
    try:
        assert first.logs == Path("run") / "runs" / first.logs.name  # shown relative to where it ran
        assert first.spans == first.logs / "spans.jsonl"
        generated = _generate(run_dir, tmp_path)
        # At once, as a user would: the request whole, the PD's stages in it.
        report, rows, columns = _report(["--run-dir", str(run_dir)], tmp_path)
        assert "the stack is running: waiting" in report.stderr
        assert f"traces of run {first.logs.name} of {run_dir} (running)" in report.stdout
        assert list(rows) == [generated], report.stdout
        assert float(rows[generated][columns.index("prefill")]) > 0, report.stdout

        door = _door_id(first.door, model_path.name)
        assert door.startswith("chatcmpl-")
        for ident in (generated, door):
            out = tmp_path / f"{ident}.html"
            drawn, _, _ = _report(["--run-dir", str(run_dir), "--waterfall", ident, "--out", str(out)], tmp_path)
            assert re.search(
                rf"^waterfall of request {ident.removeprefix('chatcmpl-')}, trace \w+: ", drawn.stdout, re.M
            )
            assert "<svg" in out.read_text()
    finally:
        first.stop()

    second = _Up(model_path, run_dir, tmp_path)
    try:
        assert second.logs != first.logs
        again = _generate(run_dir, tmp_path)
    finally:
        second.stop()
    assert (run_dir / runs.LATEST).resolve() == (tmp_path / second.logs).resolve()

    report, rows, _ = _report(["--run-dir", str(run_dir)], tmp_path)
    assert list(rows) == [again], report.stdout  # the latest run only
    assert "(stopped)" in report.stdout and "the stack is running" not in report.stderr
    _, rows, _ = _report(["--run-dir", str(run_dir), "--run", first.logs.name], tmp_path)
    assert set(rows) == {generated, door.removeprefix("chatcmpl-")}
    _, rows, _ = _report(["--run-dir", str(run_dir), "--all"], tmp_path)
    assert set(rows) == {generated, door.removeprefix("chatcmpl-"), again}

    for up in (first, second):
        logs = tmp_path / up.logs
        json_logs = [p for p in logs.rglob("*.log") if not p.name.endswith(".native.log")]
        assert {p.name for p in json_logs} == {"encoder-0.log", "pd.log", "router.log"}
        for path in json_logs:
            for number, line in enumerate(path.read_text().splitlines(), 1):
                assert isinstance(json.loads(line), dict), f"{path}:{number}: {line}"
        # Mooncake's glog (the store client in the encoder) is kept, beside the JSON lines.
        assert "InitGoogleLogging" in (logs / "encoder-0.native.log").read_text()
        assert {p.name for p in (logs / "store").iterdir()} >= {"mooncake_master.native.log"}
