"""Real Mooncake Store processes for the integration tests (master + one holder on loopback)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from libs.launch.store import StoreProcesses, start_store

MiB = 1 << 20


def _require_mooncake() -> None:
    """The store is a locked dependency (requirements.lock): its absence is a broken environment, which
    fails these tests rather than skipping them (a skip would let CI pass without them)."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"mooncake-transfer-engine-non-cuda (requirements.lock) does not import: {exc}")


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
