"""Qwen2.5-Omni thinker: E, P and D in separate processes reproduce the model's own generate()."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from libs.engine.encoder_runner import EncoderRunner
from libs.engine.lm_runtime import LanguageModelRuntime
from tests.engine.mixes import mixes
from tests.engine.staged import reference_for, rel_diff, run_staged

MIX_NAMES = ["text", "image", "two_images", "video", "audio", "audio_image"]


@pytest.fixture(scope="module")
def staged(omni_path: Path, omni_encoder: EncoderRunner) -> dict[str, Any]:
    return run_staged(omni_path, mixes(omni_encoder.modalities))


@pytest.mark.timeout(240)
def test_stages_ran_in_three_processes(staged: dict[str, Any]) -> None:
    assert len(set(staged["pids"].values())) == 3


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mix_name", MIX_NAMES)
def test_staged_tokens_and_logits_match_generate(
    mix_name: str,
    staged: dict[str, Any],
    omni_reference: Any,
    omni_runtime: LanguageModelRuntime,
    omni_encoder: EncoderRunner,
) -> None:
    mix = next(m for m in mixes(omni_encoder.modalities) if m.name == mix_name)
    pre = staged["prefill"][mix_name]
    ref_tokens, ref_logits = reference_for(omni_reference, omni_runtime, omni_encoder.adapter, mix, pre["layouts"])
    tokens = list(pre["result"]["first"]["token_ids"])
    logits = [pre["logits"]]
    if mix_name in staged["decode"]["results"]:
        tokens += staged["decode"]["results"][mix_name]["tokens"]
        logits += list(staged["decode_logits"][f"{mix_name}/logits"])
    assert tokens == ref_tokens
    assert len(logits) == len(ref_logits)
    for ours, ref in zip(logits, ref_logits, strict=True):
        assert rel_diff(ours, ref) <= 1e-5


@pytest.mark.timeout(240)
def test_decode_batched_all_sequences(staged: dict[str, Any]) -> None:
    # Every mix that reached decode ran in the first step together: one forward, several sequences.
    assert staged["decode"]["batch_sizes"][0] == len(staged["decode"]["results"]) >= 4


@pytest.mark.timeout(240)
def test_encoder_process_holds_no_language_model_weights(staged: dict[str, Any]) -> None:
    loaded = staged["loaded"]["encoder"]
    assert loaded["loaded"] and loaded["module_keys"]
    assert all(n.startswith(("thinker.visual.", "thinker.audio_tower.")) for n in loaded["loaded"])
    assert all(k.startswith(("visual.", "audio_tower.")) for k in loaded["module_keys"])
    assert not any("embed_tokens" in n or "lm_head" in n for n in loaded["loaded"])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_language_model_processes_hold_no_encoder_weights(role: str, staged: dict[str, Any]) -> None:
    loaded = staged["loaded"][role]
    assert loaded["loaded"]
    assert all(n.startswith(("thinker.model.", "thinker.lm_head.")) for n in loaded["loaded"])
    assert not any("visual" in k or "audio" in k for k in loaded["module_keys"])
