"""Real Mooncake Store processes for the integration tests (master + one holder on loopback)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from libs.cache.process import StoreProcesses, start_store

MiB = 1 << 20


def _require_mooncake() -> None:
    pytest.importorskip("mooncake.store", reason="mooncake-transfer-engine-non-cuda is not installed")


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreProcesses]:
    """One store for the tests that leave it healthy; 16 MiB, so a 20 MiB entry finds it full."""
    _require_mooncake()
    procs = start_store(tmp_path_factory.mktemp("mooncake"), segment_size=16 * MiB)
    yield procs
    procs.stop()


@pytest.fixture
def own_store(tmp_path: Path) -> Iterator[StoreProcesses]:
    """A store a test may kill."""
    _require_mooncake()
    procs = start_store(tmp_path / "mooncake", segment_size=16 * MiB)
    yield procs
    procs.stop()
