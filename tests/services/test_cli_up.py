"""`epd up` as a user runs it (the installed `epd` script, a subprocess stopped with Ctrl-C), on the
cheapest stack (colocated, the tiny model), driven by the lines it prints:

- one stack per run directory: a lock left by a killed `epd up` is taken over with a note; a
  second `epd up` in the directory is refused at once, naming it, its holder and `--run-dir`, and
  the first stack keeps its address file and keeps serving `epd generate`; stopping removes only
  what the stack wrote;
- what it prints works as pasted: the curl command answers a chat completion at the door's full
  URL, and the base URL is the one OpenAI clients take;
- `epd generate` prints a human finish reason (`length`); `epd transcribe` on a model that is not
  a speech model is refused, naming the model and the command to use;
- Ctrl-C: "stopping ..." comes first, then each service as it exits, then the statuses.
"""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from libs.model.media import synthetic
from tests.support.epd_cli import EPD, Lines, cli_env, run_epd

pytestmark = pytest.mark.stack


def _dead_pid() -> int:
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    return done.pid


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_epd_up_holds_its_run_directory_and_prints_what_works(model_path: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    killed = _dead_pid()
    (run_dir / "epd.lock").write_text(f"{killed}\n")  # what an `epd up` killed with -9 leaves
    (run_dir / "notes.txt").write_text("the user's")
    up_args = ["up", "--layout", "colocated", "--model", str(model_path), "--run-dir", str(run_dir)]
    up_args += ["--trace-exporter", "none", "--no-supervise"]
    up = subprocess.Popen(
        [EPD, *up_args], cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines = Lines(up)
    try:
        lines.until(rf"took over {re.escape(str(run_dir / 'epd.lock'))}: the stack of PID {killed} left it", 120)
        address = lines.until(r"^router listening on (\S+)", 300).group(1)
        base_url = lines.until(r"^OpenAI-compatible API \(model \S+\): base_url=(http://\S+/v1)$", 60).group(1)
        curl = lines.until(r"^  (curl .*)$", 10).group(1)
        lines.until(r"^Ctrl-C stops the stack\.$", 10)
        assert (run_dir / "router.address").read_text() == address

        # The printed curl, pasted: the door's full URL, a JSON body, an OpenAI chat completion back.
        words = shlex.split(curl)
        assert f"{base_url}/chat/completions" in words
        pasted = subprocess.run(words, capture_output=True, text=True, timeout=120)
        assert pasted.returncode == 0, pasted.stderr
        assert json.loads(pasted.stdout)["choices"][0]["message"]["role"] == "assistant"

        # A second stack in the same directory: refused at once, the first one untouched.
        second = run_epd(up_args, cwd=tmp_path, timeout_s=60)
        assert second.returncode == 1
        assert f"{run_dir} is in use by another running stack (PID {up.pid})" in second.stderr
        assert f"--run-dir {tmp_path / 'run-2'}" in second.stderr
        assert "router listening" not in second.stdout
        assert (run_dir / "router.address").read_text() == address

        generated = run_epd(["generate", "Hello", "--run-dir", str(run_dir), "--max-tokens", "4"], tmp_path, 120)
        assert generated.returncode == 0, generated.stderr
        assert re.search(r"^\[\S+\] 4 tokens, length, ttft [\d.]+ ms", generated.stderr, re.MULTILINE), generated.stderr

        clip = tmp_path / "speech.wav"
        clip.write_bytes(synthetic.wav_bytes(1.0, seed=3))
        refused = run_epd(["transcribe", str(clip), "--run-dir", str(run_dir)], tmp_path, 60)
        assert refused.returncode == 2 and refused.stdout == ""
        assert f"the stack serves {model_path.name}, which is not a speech model" in refused.stderr
        assert f"epd generate --audio {clip}" in refused.stderr
    finally:
        up.send_signal(signal.SIGINT)  # Ctrl-C
    lines.until(r"^stopping the stack \(", 60)  # said first, before any service has stopped
    out = lines.rest(120)
    up.wait(60)
    assert up.returncode == 0, out
    stopping = out.index("stopping the stack (")
    exits = [m.start() for m in re.finditer(r"^  \S+ exited \(0\)$", out, re.MULTILINE)]
    assert len(exits) == 2 and all(stopping < at for at in exits), out
    statuses = re.search(r"^stopped: (\{.*\})$", out, re.MULTILINE)
    assert statuses is not None and out.index("stopped: ") > max(exits)
    # Only what the stack wrote is gone: its address and lock; the run's logs and the user's file stay.
    assert sorted(p.name for p in run_dir.iterdir()) == ["latest", "notes.txt", "runs"]
    assert {p.name for p in (run_dir / "latest").iterdir()} >= {"colocated.log", "openai_door.log"}
    after = run_epd(["generate", "Hello", "--run-dir", str(run_dir)], tmp_path, 60)
    assert after.returncode == 2 and "no --address and no running `epd up` stack" in after.stderr
