"""Contract tooling: buf lint/format/breaking are clean, generated code is current, and the drift
and breaking checks do fail when they should (on a scratch copy of the repository)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUF = str(Path(sys.executable).parent / "buf")
SNAPSHOTS = sorted(p for p in (ROOT / "proto" / "snapshots").iterdir() if p.is_dir())


def _run(cmd: list[str], cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)


def _scratch_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "proto", copy / "proto")
    shutil.copytree(
        ROOT / "libs" / "contract", copy / "libs" / "contract", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy(ROOT / "buf.yaml", copy / "buf.yaml")
    return copy


def test_buf_lint_is_clean() -> None:
    result = _run([BUF, "lint"])
    assert result.returncode == 0, result.stdout + result.stderr


def test_buf_format_is_clean() -> None:
    result = _run([BUF, "format", "-d", "--exit-code"])
    assert result.returncode == 0, result.stdout + result.stderr


def test_there_is_a_released_snapshot() -> None:
    assert [p.name for p in SNAPSHOTS][:1] == ["v1.0"]


@pytest.mark.parametrize("snapshot", SNAPSHOTS, ids=[p.name for p in SNAPSHOTS])
def test_buf_breaking_against_every_snapshot(snapshot: Path) -> None:
    result = _run([BUF, "breaking", "--against", str(snapshot.relative_to(ROOT))])
    assert result.returncode == 0, result.stdout + result.stderr


def test_generated_code_is_current() -> None:
    result = _run([sys.executable, "proto/codegen.py", "--check"])
    assert result.returncode == 0, result.stdout + result.stderr


def test_drift_check_fails_on_unregenerated_proto_edit(tmp_path: Path) -> None:
    copy = _scratch_copy(tmp_path)
    proto = copy / "proto" / "epd" / "v1" / "media.proto"
    proto.write_text(
        proto.read_text().replace("  string id = 5;", "  string id = 5;\n  // A new field.\n  string note = 7;")
    )
    result = _run([sys.executable, "proto/codegen.py", "--check"], cwd=copy)
    assert result.returncode == 1
    assert "out of date" in result.stderr and "media_pb2.py" in result.stderr
    # Regenerating fixes it.
    assert _run([sys.executable, "proto/codegen.py"], cwd=copy).returncode == 0
    assert _run([sys.executable, "proto/codegen.py", "--check"], cwd=copy).returncode == 0


def test_breaking_change_is_caught(tmp_path: Path) -> None:
    copy = _scratch_copy(tmp_path)
    proto = copy / "proto" / "epd" / "v1" / "tensor.proto"
    proto.write_text(proto.read_text().replace("uint64 address = 1;", "int64 address = 1;"))
    result = _run([BUF, "breaking", "--against", "proto/snapshots/v1.0"], cwd=copy)
    assert result.returncode != 0
    assert 'Field "1" with name "address" on message "MemoryRegion" changed type' in result.stdout


def test_import_layering_holds() -> None:
    result = _run([str(Path(sys.executable).parent / "lint-imports")])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_import_layering_catches_a_service_importing_another(tmp_path: Path) -> None:
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "services", copy / "services", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "libs", copy / "libs", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    (copy / "services" / "router" / "bad.py").write_text("import services.encoder\n")
    result = subprocess.run(
        [str(Path(sys.executable).parent / "lint-imports")],
        cwd=copy,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(copy), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode != 0
    assert "services.router.bad -> services.encoder" in result.stdout
