"""libs/torchvision_guard.py: PyPI's CUDA-linked torchvision imports in every interpreter of the
venv (fresh ones too: vLLM spawns them), through the start-up hook `make deps` installs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from libs import torchvision_guard

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str, *, env: dict[str, str] | None = None, cwd: Path = ROOT) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_the_venv_carries_the_hook() -> None:
    pth = Path(torchvision_guard.sysconfig.get_paths()["purelib"]) / torchvision_guard.PTH_NAME
    assert pth.read_text() == torchvision_guard.pth_line(Path(torchvision_guard.__file__).resolve())


def test_a_fresh_interpreter_imports_torchvision_and_stays_lazy_until_then() -> None:
    out = _python(
        """
        import sys
        before = "torch" in sys.modules
        import torchvision, torch
        guard = sys.modules["epd_torchvision_guard"]
        print(before, guard.outcome, torch.ops.torchvision.nms is not None)
        """
    )
    # torch is not imported at start-up (the hook is lazy); the CUDA build gets the stub schemas
    assert out == "False stubbed True"


def test_the_hook_works_whatever_pythonpath_says(tmp_path: Path) -> None:
    # Another checkout first on the path (cross-version tests) or none at all: the .pth loads
    # the guard by absolute path.
    (tmp_path / "libs").mkdir()
    out = _python("import torchvision; print('ok')", env={"PYTHONPATH": str(tmp_path)}, cwd=tmp_path)
    assert out == "ok"


def test_spawned_children_import_torchvision(tmp_path: Path) -> None:
    # vLLM's EngineCore and Worker are multiprocessing "spawn" children: fresh interpreters.
    script = tmp_path / "spawn_child.py"
    script.write_text(
        textwrap.dedent(
            """
            import multiprocessing as mp

            def child(q):
                import torchvision
                q.put(torchvision.__version__)

            if __name__ == "__main__":
                ctx = mp.get_context("spawn")
                q = ctx.Queue()
                p = ctx.Process(target=child, args=(q,))
                p.start()
                print(q.get(timeout=60))
                p.join(30)
            """
        )
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().startswith("0.28.0")


def test_install_without_torchvision_reports_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torchvision_guard.importlib.machinery.PathFinder, "find_spec", lambda name: None)
    monkeypatch.delitem(sys.modules, "torchvision", raising=False)
    monkeypatch.setattr(torchvision_guard, "_library", None)
    assert torchvision_guard.install() == "absent"


def test_pth_line_is_silent_when_the_file_is_gone(tmp_path: Path) -> None:
    line = torchvision_guard.pth_line(tmp_path / "missing.py")
    (tmp_path / "x.pth").write_text(line)
    done = subprocess.run(
        [sys.executable, "-c", "import site, sys; site.addsitedir(sys.argv[1]); print('ok')", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok" and done.stderr == ""
