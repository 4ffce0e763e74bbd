"""The shared type vocabulary loads without torch (slow to import): the router, the cache
keys and the failure reasons use it in processes that never run a model."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

TORCH_FREE = (
    "libs.model.types",
    "libs.model.errors",
    "libs.model.content",
    "libs.cache.keys",
    "libs.contract.reasons",
    "services.router.service",
)


@pytest.mark.parametrize("module", TORCH_FREE)
def test_importing_does_not_load_torch(module: str) -> None:
    probe = f"import sys, {module}; sys.exit(3 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", probe], timeout=120).returncode == 0, f"{module} loads torch"


def test_the_probe_sees_torch_when_it_is_loaded() -> None:
    probe = "import sys, libs.model.dtypes; sys.exit(3 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", probe], timeout=120).returncode == 3
