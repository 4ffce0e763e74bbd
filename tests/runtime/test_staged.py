"""Every family: E, P and D in separate processes reproduce the model's own generate()."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from libs.model.checkpoint import Checkpoint
from libs.model.types import Modality
from tests.support.engines import FAMILIES, Engines
from tests.support.mixes import Mix, mixes
from tests.support.staged import reference_for, rel_diff, run_staged

pytestmark = pytest.mark.stack

# (image_exif and audio_stereo_44k run end to end in tests/services/test_golden.py; a family's mixes
# decode in one batch here, at most DecodeRunner's default 8.)
VISION_MIXES = ["text", "image", "two_images", "video", "video_capped"]
MIX_NAMES = {
    "qwen2_5_omni": [*VISION_MIXES, "audio", "audio_image"],
    "qwen2_5_vl": VISION_MIXES,
    "qwen3_vl": VISION_MIXES,
}
CASES = [(family, mix) for family in FAMILIES for mix in MIX_NAMES[family]]

# Checkpoint tensor names each role may read (hub layouts differ per family).
ENCODER_PREFIXES = {
    "qwen2_5_omni": ("thinker.visual.", "thinker.audio_tower."),
    "qwen2_5_vl": ("visual.",),
    "qwen3_vl": ("model.visual.",),
}
LM_PREFIXES = {
    "qwen2_5_omni": ("thinker.model.", "thinker.lm_head."),
    "qwen2_5_vl": ("model.", "lm_head."),
    "qwen3_vl": ("model.language_model.", "lm_head."),
}


def family_mixes(family: str) -> list[Mix]:
    return [m for m in mixes(frozenset(Modality)) if m.name in MIX_NAMES[family]]


@pytest.fixture(scope="module")
def staged(engines: Callable[[str], Engines]) -> dict[str, dict[str, Any]]:
    runs = {family: (engines(family).path, family_mixes(family)) for family in FAMILIES}

    def warm_references() -> None:  # the in-process side of the comparison, built meanwhile
        for family in FAMILIES:
            eng = engines(family)
            assert eng.encoder and eng.runtime and eng.reference is not None

    return run_staged(runs, warm_references)


@pytest.mark.timeout(240)
def test_stages_ran_in_three_processes(staged: dict[str, dict[str, Any]]) -> None:
    for family in FAMILIES:
        assert len(set(staged[family]["pids"].values())) == 3


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("family", "mix_name"), CASES)
def test_staged_tokens_and_logits_match_generate(
    family: str, mix_name: str, staged: dict[str, dict[str, Any]], engines: Callable[[str], Engines]
) -> None:
    eng = engines(family)
    run = staged[family]
    pre = run["prefill"][mix_name]
    ref_tokens, ref_logits = reference_for(
        eng.reference,
        eng.runtime,
        eng.encoder.adapter,
        next(m for m in family_mixes(family) if m.name == mix_name),
        pre["layouts"],
    )
    tokens = list(pre["result"]["first"]["token_ids"])
    logits = [pre["logits"]]
    if mix_name in run["decode"]["results"]:
        tokens += run["decode"]["results"][mix_name]["tokens"]
        logits += list(run["decode_logits"][f"{mix_name}/logits"])
    assert tokens == ref_tokens
    assert len(logits) == len(ref_logits)
    for ours, ref in zip(logits, ref_logits, strict=True):
        assert rel_diff(ours, ref) <= 1e-5


@pytest.mark.timeout(240)
def test_qwen3_vl_items_cross_with_deepstack_features(staged: dict[str, dict[str, Any]]) -> None:
    # Deepstack features travel with the embeddings: two per item (one per deepstack layer).
    names = staged["qwen3_vl"]["prefill"]["image"]["item_tensors"]
    assert names == ["item0/deepstack.0", "item0/deepstack.1", "item0/embeddings"]
    assert staged["qwen2_5_vl"]["prefill"]["image"]["item_tensors"] == ["item0/embeddings"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", FAMILIES)
def test_decode_batched_all_sequences(family: str, staged: dict[str, dict[str, Any]]) -> None:
    # Every mix that reached decode ran in the first step together: one forward, several sequences.
    decode = staged[family]["decode"]
    assert decode["batch_sizes"][0] == len(decode["results"]) >= 3


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", FAMILIES)
def test_encoder_process_holds_no_language_model_weights(
    family: str, staged: dict[str, dict[str, Any]], engines: Callable[[str], Engines]
) -> None:
    loaded = staged[family]["loaded"]["encoder"]
    assert loaded["loaded"] and loaded["module_keys"]
    assert all(n.startswith(ENCODER_PREFIXES[family]) for n in loaded["loaded"])
    assert all(k.startswith(("visual.", "audio_tower.")) for k in loaded["module_keys"])
    assert not any("embed_tokens" in n or "lm_head" in n for n in loaded["loaded"])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", FAMILIES)
def test_language_model_processes_hold_no_encoder_weights(
    family: str, staged: dict[str, dict[str, Any]], engines: Callable[[str], Engines]
) -> None:
    run = staged[family]
    for role in ("prefill", "decode"):
        loaded = run["loaded"][role]
        assert loaded["loaded"]
        assert all(n.startswith(LM_PREFIXES[family]) and "visual" not in n for n in loaded["loaded"])
        assert not any("visual" in k or "audio" in k for k in loaded["module_keys"])
    # Encoder and language-model reads partition the checkpoint: nothing read twice, nothing left.
    encoder, lm = set(run["loaded"]["encoder"]["loaded"]), set(run["loaded"]["prefill"]["loaded"])
    assert not encoder & lm
    assert encoder | lm == set(Checkpoint(engines(family).path).tensor_names())
