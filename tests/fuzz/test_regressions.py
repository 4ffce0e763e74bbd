"""Every saved fuzz input, replayed: the seeds of each target and each input a fuzzing run found
(`tests/fuzz/regressions/<target>/`, one file per find, fixed since). Each may only raise its
target's typed errors (tests/support/fuzz_targets.py); a regression here is a crash that came back."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.fuzz_targets import TARGETS, call, target

pytestmark = pytest.mark.integration

REGRESSIONS = Path(__file__).parent / "regressions"


def _cases() -> list[object]:
    cases = []
    for name in TARGETS:
        inputs = [(f"seed-{i}", seed) for i, seed in enumerate(target(name).seeds())]
        folder = REGRESSIONS / name
        if folder.is_dir():
            inputs += [(path.name, path.read_bytes()) for path in sorted(folder.iterdir()) if path.is_file()]
        cases += [pytest.param(name, data, id=f"{name}-{case}") for case, data in inputs]
    return cases


@pytest.mark.parametrize(("name", "data"), _cases())
def test_saved_input_gets_only_typed_errors(name: str, data: bytes) -> None:
    call(target(name), data)


def test_every_regression_folder_names_a_target() -> None:
    if REGRESSIONS.is_dir():
        assert {p.name for p in REGRESSIONS.iterdir() if p.is_dir()} <= set(TARGETS)
