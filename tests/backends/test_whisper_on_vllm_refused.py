"""Whisper on vLLM is refused at start-up, naming the pairing (issue 25: vLLM's CPU build serves
the converted tiny.en checkpoint but returns empty transcripts): by the vLLM request planner and
by each vLLM backend's start, before vLLM is imported or anything is loaded. Its launch-side
counterparts (`epd up`'s checks) are in tests/launch/test_config.py."""

from __future__ import annotations

import asyncio
import importlib
import json
from pathlib import Path

import pytest

from libs.backends.identity import model_type, refusal
from libs.backends.settings import EngineSettings

pytestmark = pytest.mark.unit

MESSAGE = "vLLM returns empty transcripts for the converted Whisper checkpoint (issue 25)"


@pytest.fixture()
def whisper(tmp_path: Path) -> Path:
    """What the refusal reads of the project's converted checkpoint (its config.json)."""
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "whisper", "architectures": ["WhisperForConditionalGeneration"]})
    )
    return tmp_path


def test_the_pairing_is_named_with_the_reason(whisper: Path) -> None:
    assert model_type(whisper) == "whisper"
    why = refusal("vllm", "whisper")
    assert why is not None and why.startswith("--engine vllm with a whisper checkpoint is refused: " + MESSAGE)
    assert "serve Whisper on the reference engine" in why
    assert refusal("reference", "whisper") is None and refusal("vllm", "qwen2_5_omni") is None
    assert model_type(whisper / "missing") == ""  # unreadable: nothing to refuse here


def test_the_request_planner_refuses_a_whisper_checkpoint(whisper: Path) -> None:
    from libs.backends.vllm.requests import RequestPlanner

    with pytest.raises(ValueError, match=r"refused: vLLM returns empty transcripts"):
        RequestPlanner(whisper)


@pytest.mark.parametrize("role", ["pd", "prefill", "decode"])
def test_each_vllm_backend_refuses_to_start_on_a_whisper_checkpoint(whisper: Path, role: str) -> None:
    module = importlib.import_module(f"libs.backends.vllm.{role}")
    with pytest.raises(SystemExit) as ended:
        asyncio.run(module.start(EngineSettings(model=whisper, engine="vllm")))
    assert str(ended.value.code).startswith("epd: --engine vllm with a whisper checkpoint is refused: " + MESSAGE)
