"""The `epd` command line as a user runs it, each command a subprocess of the installed `epd`
script, stopped by its PID:

- `make run`'s own command line (read from the Makefile): the demo's five requests succeed, every
  service exits 0, and the last request, whose media the earlier ones carried, shows 0 in its
  `encode` column and a `cache_load` above 0, in the printed table and in the traces;
- `epd up` / `epd generate` / `epd trace report`: the stack comes up, generate prints what the
  router streams (the same text a Python client gets; a seeded sample twice the same), transcribe
  is refused on this chat model (the router advertises it), Ctrl-C stops every service cleanly, and
  the report splits the requests' time to first token.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
from pathlib import Path

import pytest

from libs.client.generate import build_request, media_from_file
from libs.contract.epd.v1 import media_pb2, sampling_pb2
from libs.launch.process import ROOT
from libs.model.media import synthetic
from libs.telemetry.report import breakdowns
from libs.telemetry.spans import load_jsonl
from tests.support.epd_cli import EPD, Lines, cli_env, parse_table, run_epd
from tests.support.stacks import run_requests

pytestmark = pytest.mark.stack


def _make_run_args() -> list[str]:
    """The arguments `make run` gives `epd`, as make itself expands its recipe (a dry run: nothing
    is executed, not even the dependency installation it would do first)."""
    env = {k: v for k, v in os.environ.items() if k not in ("ENGINE", "MAKEFLAGS")}  # the defaults
    dry = subprocess.run(
        ["make", "-n", "--no-print-directory", "run"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert dry.returncode == 0, dry.stderr
    (line,) = [line for line in dry.stdout.splitlines() if " demo " in line]
    words = shlex.split(line)
    assert Path(words[0]).name == "epd", line
    return words[1:]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_make_run_demo(model_path: Path, tmp_path: Path) -> None:
    args = _make_run_args()
    assert args[:1] == ["demo"] and "--cache-store" in args
    spans = tmp_path / "traces" / "spans.jsonl"
    extra = ["--model", str(model_path), "--run-dir", str(tmp_path / "run"), "--trace-file", str(spans)]
    done = run_epd([*args, *extra], cwd=tmp_path, timeout_s=480)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    # The outputs table: every request streamed its tokens.
    _, outputs = parse_table(out, "request ")
    assert set(outputs) == {"text", "image", "video", "audio", "audio+image"}
    assert all(cells[0] != "FAILED" and int(cells[0]) > 0 for cells in outputs.values()), outputs
    statuses = re.search(r"^stopped: (\{.*\});", out, re.MULTILINE)
    assert statuses is not None and set(re.findall(r": (-?\d+|None)", statuses.group(1))) == {"0"}, out
    # The attribution table: the repeated media were found in the shared store, not computed.
    columns, split = parse_table(out, "request              ")
    encode, cache_load = columns.index("encode"), columns.index("cache_load")
    repeated = split["demo-audio-image"]
    assert float(repeated[encode]) == 0 and float(repeated[cache_load]) > 0, out
    assert float(split["demo-image"][encode]) > 0  # its first time: computed
    # The same from the traces the demo wrote: the router found both items in the store and sent
    # cache-only jobs; no encoder computed them.
    recorded = load_jsonl(spans)
    (repeated_trace,) = [b for b in breakdowns(recorded) if b.request_id == "demo-audio-image"]
    assert repeated_trace.parts["encode"] == 0 and repeated_trace.parts["cache_load"] > 0
    trace = [s for s in recorded if s.trace_id == repeated_trace.trace_id]
    items = [s for s in trace if s.name == "epd.encode.item"]
    assert len(items) == 2 and {s.attributes["epd.cache.policy"] for s in items} == {"CACHE_POLICY_CACHED_ONLY"}
    assert not [s for s in trace if s.name == "encoder.compute"]
    assert (spans.parent / "waterfall.html").read_text().count("<svg") >= 1


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_epd_up_generate_and_trace_report(model_path: Path, tmp_path: Path) -> None:
    run_dir, spans = tmp_path / "run", tmp_path / "spans.jsonl"
    image = tmp_path / "cat.png"
    image.write_bytes(synthetic.png_bytes(80, 60, seed=11))
    stack = ["--layout", "e+pd", "--encoders", "1", "--model", str(model_path)]
    up = subprocess.Popen(
        [EPD, "up", *stack, "--run-dir", str(run_dir), "--trace-file", str(spans)],
        cwd=tmp_path,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = Lines(up)
    try:
        lines.until(r"^Ctrl-C stops the stack\.$", 240)  # after the address file is written
        address = (run_dir / "router.address").read_text()
        prompt = ["what is in this image", "--image", str(image), "--run-dir", str(run_dir)]
        greedy = run_epd(["generate", *prompt, "--max-tokens", "12"], cwd=tmp_path, timeout_s=120)
        assert greedy.returncode == 0, greedy.stderr
        assert re.search(r"\] 12 tokens, length, ttft [\d.]+ ms", greedy.stderr), greedy.stderr
        # What it printed is what the router streams (a Python client's request, same bytes).
        request = build_request(
            "what is in this image",
            [media_from_file(image, media_pb2.MODALITY_IMAGE)],
            sampling=sampling_pb2.SamplingParams(max_tokens=12),
        )
        assert greedy.stdout == run_requests(address, [request])[0].text + "\n"
        seeded = [
            run_epd(["generate", *prompt, "--max-tokens", "12", "--temperature", "0.9", "--seed", "5"], tmp_path, 120)
            for _ in range(2)
        ]
        assert all(s.returncode == 0 for s in seeded)
        assert seeded[0].stdout == seeded[1].stdout != greedy.stdout
        # The router advertises its back ends' model: a transcription is refused on a chat model.
        clip = tmp_path / "speech.wav"
        clip.write_bytes(synthetic.wav_bytes(1.0, seed=3))
        refused = run_epd(["transcribe", str(clip), "--run-dir", str(run_dir)], tmp_path, 60)
        assert refused.returncode == 2, refused.stderr
        assert f"the stack serves {model_path.name}, which is not a speech model" in refused.stderr
    finally:
        up.send_signal(signal.SIGINT)  # Ctrl-C
    out = lines.rest(120)
    up.wait(60)
    assert up.returncode == 0, out
    listening = re.search(r"^router listening on \S+ +\(e\+pd; (.*); logs in", out, re.MULTILINE)
    assert listening is not None, out
    pids = {name: int(pid) for name, pid in (p.rsplit(" ", 1) for p in listening.group(1).split(", "))}
    assert set(pids) == {"encoder-0", "pd", "router"}  # the door in the router's process: the default
    assert re.search(r"^OpenAI-compatible API \(model \S+\): base_url=http://\S+/v1$", out, re.MULTILINE), out
    statuses = re.search(r"^stopped: (\{.*\})$", out, re.MULTILINE)
    assert statuses is not None and set(re.findall(r": (-?\d+|None)", statuses.group(1))) == {"0"}, out
    assert not (run_dir / "router.address").exists()
    assert not [name for name, pid in pids.items() if Path(f"/proc/{pid}").exists()]  # all gone

    report = run_epd(
        ["trace", "report", "--file", str(spans), "--waterfall", "slowest", "--out", "w.html"], tmp_path, 60
    )
    assert report.returncode == 0, report.stderr
    columns, rows = parse_table(report.stdout, "request ")
    assert columns[:2] == ["ttft", "queue"] and "encode" in columns
    assert len([r for r in rows if not r.startswith("p")]) >= 4  # the four generate requests
    assert {"p50", "p90", "p99"} <= set(rows)
    assert "<svg" in (tmp_path / "w.html").read_text()
