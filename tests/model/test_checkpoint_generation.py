"""`ensure_checkpoint` from processes that start at once (a stack's services, the suite's workers):
the checkpoint is generated once and never replaced while another reads it."""

from __future__ import annotations

import fcntl
import threading
from pathlib import Path
from typing import Any

import pytest

from libs.model.checkpoints import generate

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def test_concurrent_callers_generate_the_checkpoint_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    out = tmp_path / "models" / "qwen2_5_vl-tiny"
    fingerprint = generate.recipe_fingerprint("qwen2_5_vl", "tiny", 0)
    first_generating, second_at_lock, release = threading.Event(), threading.Event(), threading.Event()
    generated: list[Path] = []
    lock_calls: list[int] = []

    def fake_generate(family: str, size: str, path: Path, *, seed: int = 0) -> Path:
        generated.append(path)
        first_generating.set()
        assert release.wait(30), "the test never released the first generation"
        path.mkdir(parents=True)
        (path / "model.safetensors").write_bytes(b"weights")
        (path / generate.RECIPE_FILE).write_text(f'{{"fingerprint": "{fingerprint}"}}')
        return path

    class Flock:
        """fcntl, noting when the second caller reaches the lock (it then blocks on it)."""

        LOCK_EX = fcntl.LOCK_EX

        @staticmethod
        def flock(fd: Any, operation: int) -> None:
            lock_calls.append(operation)
            if len(lock_calls) == 2:
                second_at_lock.set()
            fcntl.flock(fd, operation)

    monkeypatch.setattr(generate, "default_dir", lambda family, size: out)
    monkeypatch.setattr(generate, "generate_checkpoint", fake_generate)
    monkeypatch.setattr(generate, "fcntl", Flock)

    results: list[Path] = []
    first = threading.Thread(target=lambda: results.append(generate.ensure_checkpoint("qwen2_5_vl")))
    second = threading.Thread(target=lambda: results.append(generate.ensure_checkpoint("qwen2_5_vl")))
    first.start()
    assert first_generating.wait(30)
    second.start()  # finds no checkpoint yet, so it waits on the lock the first one holds
    assert second_at_lock.wait(30)
    release.set()
    first.join(30)
    second.join(30)

    assert results == [out, out]
    assert generated == [out], "the second caller found the first one's checkpoint and generated nothing"
    assert generate.ensure_checkpoint("qwen2_5_vl") == out  # current now: no lock, no generation
    assert len(lock_calls) == 2 and generated == [out]
