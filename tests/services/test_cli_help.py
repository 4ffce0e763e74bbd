"""`epd ... --help` as a user reads it: every option whose default means something shows it (the
bench's --duration, --mix and --out, generate's --max-tokens, up's --run-dir and --trace-file, the
trace report's --run-dir, ...), in every subcommand, from one formatter; and the README's curl line
is the one `epd up` prints."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from libs.cli.main import build_parser
from libs.cli.up import door_lines
from libs.launch.process import ROOT
from libs.launch.stack import Stack, StackSpec

pytestmark = pytest.mark.unit


def _commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Every (sub)command's parser by its words (`("deploy", "render")`)."""
    out = {path: parser}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out |= _commands(sub, (*path, name))
    return out


def _help_of(text: str, flag: str) -> str:
    """The help text of `flag` in a --help page, its wrapped lines joined."""
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if re.match(rf"\s+{re.escape(flag)}\b", line))
    block = [lines[at]]
    for line in lines[at + 1 :]:
        if not line.startswith(" " * 10) or re.match(r"\s+-", line):
            break
        block.append(line)
    return " ".join(" ".join(block).split())


def test_every_meaningful_default_is_shown() -> None:
    commands = _commands(build_parser())
    assert {("up",), ("generate",), ("bench",), ("plan",), ("transcribe",), ("deploy", "render")} <= set(commands)
    missing = []
    for words, parser in commands.items():
        text = parser.format_help()
        for action in parser._actions:
            if not action.option_strings or action.default in (None, "", argparse.SUPPRESS) or action.default is False:
                continue  # nothing to show: off unless given, or "unset" (its help says what happens then)
            if "default" not in _help_of(text, action.option_strings[0]):
                missing.append(f"epd {' '.join(words)} {action.option_strings[0]}")
    assert not missing, missing


@pytest.mark.parametrize(
    ("command", "flag", "shown"),
    [
        (("generate",), "--max-tokens", "(default: 64)"),
        (("up",), "--run-dir", "(default: var/run/stack)"),
        (("up",), "--trace-file", "(default: spans.jsonl in the run's directory, RUN_DIR/runs/ID/"),
        (("trace", "report"), "--run-dir", "(default: var/run/stack)"),
        (("bench",), "--mix", "(default: text=0.5,image=0.5)"),
        (("plan",), "--slo-ttft", "(default: 5.0)"),
        (("deploy", "render"), "--out", "(default: var/k8s;"),
    ],
)
def test_the_defaults_the_issue_names(command: tuple[str, ...], flag: str, shown: str) -> None:
    text = _commands(build_parser())[command].format_help()
    assert shown in _help_of(text, flag)


def test_the_readme_shows_the_curl_epd_up_prints(tmp_path: Path) -> None:
    """README's curl line is what `epd up` prints, HOST:PORT aside (tests/services/test_cli_up.py
    runs the printed one against a real door)."""
    model = tmp_path / "qwen2_5_omni-tiny"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2_5_omni"}')
    stack = Stack(StackSpec(layout="colocated", model=model, run_dir=tmp_path))
    stack.door_url = "http://HOST:PORT/v1"  # not reachable: the checkpoint's name is the model's
    base, curl = door_lines(stack)
    assert base.endswith("base_url=http://HOST:PORT/v1")
    readme = (ROOT / "README.md").read_text().splitlines()
    assert curl.strip() in readme
