"""Golden equivalence for the vision-language families: through a real E/P/D stack (router, encoder,
prefill, decode, each its own process), every vision mix streams the tokens of the model's own
generate() fed by the family's transformers processor (test_golden.py does the same for
Qwen2.5-Omni in every layout)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from libs.launch.stack import Stack, StackSpec
from libs.model.checkpoints import ensure_checkpoint
from libs.model.types import Modality
from libs.runtime.lm_runtime import LanguageModelRuntime
from tests.support.golden import expected_tokens, request_for
from tests.support.mixes import mixes
from tests.support.reference import load_reference
from tests.support.stacks import run_requests

pytestmark = pytest.mark.stack

FAMILIES = ["qwen2_5_vl", "qwen3_vl"]
MIXES = {mix.name: mix for mix in mixes(frozenset({Modality.IMAGE, Modality.VIDEO}))}


@pytest.fixture(scope="module", params=FAMILIES)
def family_stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Stack]]:
    family = str(request.param)
    path = ensure_checkpoint(family, "tiny")
    stack = Stack(StackSpec(layout="e/p/d", encoders=1, model=path, run_dir=tmp_path_factory.mktemp(family)))
    stack.up()
    try:
        yield family, stack
    finally:
        statuses = stack.down()
        assert all(code == 0 for code in statuses.values()), f"unclean exit: {statuses}"


@pytest.mark.timeout(300)
def test_vision_mixes_match_generate_on_processor_inputs(family_stack: tuple[str, Stack]) -> None:
    family, stack = family_stack
    path: Path = ensure_checkpoint(family, "tiny")
    torch.manual_seed(0)
    model, runtime = load_reference(str(path)), LanguageModelRuntime(path)
    names = sorted(MIXES)
    expected = {name: expected_tokens(model, runtime, None, MIXES[name]) for name in names}
    results = run_requests(stack.address, [request_for(MIXES[n], request_id=f"{family}-{n}") for n in names])
    assert {name: r.token_ids for name, r in zip(names, results, strict=True)} == expected
