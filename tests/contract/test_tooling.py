"""Contract tooling: buf lint/format/breaking are clean, generated code (current and per snapshot) and
wire vectors are current, and the drift, breaking and wire-vector checks do fail when they should
(on a scratch copy of the repository)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

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
    shutil.copy(ROOT / "libs" / "__init__.py", copy / "libs" / "__init__.py")
    shutil.copy(ROOT / "buf.yaml", copy / "buf.yaml")
    return copy


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} not found once in {path}"
    path.write_text(text.replace(old, new))


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


def _move_processor_options(proto: Path) -> None:
    """Move `ProcessorOptions` from media.proto to a new options.proto (same package, same wire)."""
    media = proto / "epd" / "v1" / "media.proto"
    text = media.read_text()
    start, end = text.index("// Options that change how"), text.index("// One media item of a client request.")
    (proto / "epd" / "v1" / "options.proto").write_text(
        'syntax = "proto3";\n\npackage epd.v1;\n\n' + text[start:end].rstrip() + "\n"
    )
    media.write_text(
        text[:start].replace("package epd.v1;\n", 'package epd.v1;\n\nimport "epd/v1/options.proto";\n') + text[end:]
    )


def _change(file: str, old: str, new: str) -> Callable[[Path], None]:
    return lambda proto: _edit(proto / "epd" / "v1" / file, old, new)


BREAKING_CHANGES = {
    "field type": (
        _change("tensor.proto", "uint64 address = 1;", "int64 address = 1;"),
        'Field "1" with name "address" on message "MemoryRegion" changed type',
    ),
    "field removed without reserved": (
        _change(
            "media.proto",
            "  // Client-supplied identifier, echoed back. Never used as a cache key on its own.\n  string id = 5;\n",
            "",
        ),
        'Previously present field "5" with name "id" on message "MediaItem" was deleted.',
    ),
    # FILE rules refuse a deletion even when the number and name are reserved: within v1 a field
    # is deprecated, never removed (docs/contract-evolution.md).
    "field removed with reserved": (
        _change(
            "media.proto",
            "  // Client-supplied identifier, echoed back. Never used as a cache key on its own.\n  string id = 5;\n",
            '  reserved 5;\n  reserved "id";\n',
        ),
        'Previously present field "5" with name "id" on message "MediaItem" was deleted.',
    ),
    "field renumbered": (
        _change("media.proto", "string id = 5;", "string id = 9;"),
        'Previously present field "5" with name "id" on message "MediaItem" was deleted.',
    ),
    "enum value renumbered": (
        _change("lease.proto", "RELEASE_REASON_CONSUMED = 1;", "RELEASE_REASON_CONSUMED = 3;"),
        'Previously present enum value "1" on enum "ReleaseReason" was deleted.',
    ),
    "message moved to another file": (
        _move_processor_options,
        'Previously present message "ProcessorOptions" was deleted from file.',
    ),
    "rpc removed": (
        _change(
            "stats.proto",
            "  // Returns the service's current occupancy.\n"
            "  rpc GetStats(GetStatsRequest) returns (GetStatsResponse);\n",
            "",
        ),
        'Previously present RPC "GetStats" on service "StatsService" was deleted.',
    ),
}


@pytest.mark.parametrize(("edit", "message"), BREAKING_CHANGES.values(), ids=BREAKING_CHANGES.keys())
def test_breaking_change_is_caught(tmp_path: Path, edit: Callable[[Path], None], message: str) -> None:
    copy = _scratch_copy(tmp_path)
    edit(copy / "proto")
    result = _run([BUF, "breaking", "--against", "proto/snapshots/v1.0"], cwd=copy)
    assert result.returncode != 0
    assert message in result.stdout, result.stdout + result.stderr


def _additive_change(proto: Path) -> None:
    """What a minor may do: a new field, enum value, message and RPC."""
    v1 = proto / "epd" / "v1"
    _edit(
        v1 / "media.proto",
        "  ProcessorOptions processor_options = 6;\n}",
        "  ProcessorOptions processor_options = 6;\n  // A note.\n  string note = 7;\n}",
    )
    _edit(
        v1 / "media.proto",
        "  MODALITY_AUDIO = 3;\n",
        "  MODALITY_AUDIO = 3;\n  // A document.\n  MODALITY_DOCUMENT = 4;\n",
    )
    _edit(
        v1 / "lease.proto",
        "  rpc ReleaseLeases(ReleaseLeasesRequest) returns (ReleaseLeasesResponse);\n",
        "  rpc ReleaseLeases(ReleaseLeasesRequest) returns (ReleaseLeasesResponse);\n"
        "  // Lists the leases held.\n  rpc ListLeases(ListLeasesRequest) returns (ListLeasesResponse);\n",
    )
    with (v1 / "lease.proto").open("a") as f:
        f.write(
            "\n// Request for `ListLeases`.\nmessage ListLeasesRequest {}\n"
            "\n// Response of `ListLeases`.\nmessage ListLeasesResponse {\n"
            "  // Lease ids.\n  repeated string lease_ids = 1;\n}\n"
        )


_COEXIST = """
from libs.contract.epd.v1 import media_pb2 as cur
from libs.contract.snapshots.v1_0.epd.v1 import media_pb2 as old
new = cur.MediaItem(modality=cur.MODALITY_DOCUMENT, uri="file:///a.pdf", note="n")
seen = old.MediaItem.FromString(new.SerializeToString())
print(cur.__file__.startswith(sys.argv[1]), "note" in cur.MediaItem.DESCRIPTOR.fields_by_name,
      "note" in old.MediaItem.DESCRIPTOR.fields_by_name, seen.uri, seen.modality,
      cur.MediaItem.FromString(seen.SerializeToString()) == new)
"""


def test_additive_change_passes_and_old_code_still_reads_new_bytes(tmp_path: Path) -> None:
    copy = _scratch_copy(tmp_path)
    _additive_change(copy / "proto")
    assert _run([BUF, "lint"], cwd=copy).returncode == 0
    result = _run([BUF, "breaking", "--against", "proto/snapshots/v1.0"], cwd=copy)
    assert result.returncode == 0, result.stdout + result.stderr
    assert _run([sys.executable, "proto/codegen.py"], cwd=copy).returncode == 0
    # Both copies of epd.v1 load in one process; the snapshot ignores and forwards the new field
    # and keeps the unknown enum value.
    result = _run([sys.executable, "-c", "import sys\n" + _COEXIST, str(copy)], cwd=copy)
    assert result.stdout.split() == ["True", "True", "False", "file:///a.pdf", "4", "True"], result.stderr
    # The v1.0 vectors still read the same with the extended contract.
    result = _run([sys.executable, "proto/wirevectors.py", "--check"], cwd=copy)
    assert result.returncode == 0, result.stdout + result.stderr


def test_wire_vectors_catch_a_renumbered_field(tmp_path: Path) -> None:
    copy = _scratch_copy(tmp_path)
    _edit(copy / "proto" / "epd" / "v1" / "tensor.proto", "uint64 length = 2;", "uint64 length = 12;")
    assert _run([sys.executable, "proto/codegen.py"], cwd=copy).returncode == 0
    result = _run([sys.executable, "proto/wirevectors.py", "--check"], cwd=copy)
    assert result.returncode == 1
    assert "v1.0 epd.v1.DecodeRequest: the current code reads it differently from its .txtpb" in result.stderr
    # MemoryRegion.length (field 2) is unknown to the changed code.
    assert "-        length: 160\n" in result.stderr and "+        2: 160\n" in result.stderr
    assert "wirevectors: check failed" in result.stderr


def test_wire_vector_check_passes() -> None:
    result = _run([sys.executable, "proto/wirevectors.py", "--check"])
    assert result.returncode == 0, result.stdout + result.stderr
    snapshots = len(SNAPSHOTS)
    assert f"{16 * snapshots} vectors in {snapshots} snapshots are current and readable" in result.stdout


def test_drift_check_covers_snapshot_code(tmp_path: Path) -> None:
    copy = _scratch_copy(tmp_path)
    snapshot_code = copy / "libs" / "contract" / "snapshots"
    (snapshot_code / "v1_0" / "epd" / "v1" / "lease_pb2.py").unlink()
    (snapshot_code / "v0_9").mkdir()
    (snapshot_code / "v0_9" / "__init__.py").write_text("")
    _edit(
        snapshot_code / "v1_0" / "_pool.py",
        "POOL = _descriptor_pool.DescriptorPool()",
        "POOL = _descriptor_pool.Default()",
    )
    result = _run([sys.executable, "proto/codegen.py", "--check"], cwd=copy)
    assert result.returncode == 1
    assert "snapshots/v1_0/epd/v1/lease_pb2.py (not committed)" in result.stderr
    assert "snapshots/v0_9/__init__.py (stale)" in result.stderr
    assert "snapshots/v1_0/_pool.py" in result.stderr and "+POOL = _descriptor_pool.DescriptorPool()" in result.stderr
    assert _run([sys.executable, "proto/codegen.py"], cwd=copy).returncode == 0
    assert not (snapshot_code / "v0_9").exists()
    assert _run([sys.executable, "proto/codegen.py", "--check"], cwd=copy).returncode == 0


def test_import_layering_holds() -> None:
    result = _run([str(Path(sys.executable).parent / "lint-imports")])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "source", "reported"),
    [
        ("services/router/bad.py", "import services.encoder\n", "services.router.bad -> services.encoder"),
        ("services/router/bad.py", "import services.openai_door\n", "services.router.bad -> services.openai_door"),
        ("libs/model/bad.py", "import libs.runtime.kv\n", "libs.model.bad -> libs.runtime.kv"),
        ("libs/cache/bad.py", "import libs.runtime.kv\n", "libs.cache.bad -> libs.runtime.kv"),
        (
            "libs/backends/hosting/bad.py",
            "import libs.backends.reference\n",
            "libs.backends.hosting.bad -> libs.backends.reference",
        ),
    ],
)
def test_import_layering_catches_a_broken_contract(tmp_path: Path, module: str, source: str, reported: str) -> None:
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "services", copy / "services", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "libs", copy / "libs", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    (copy / module).write_text(source)
    result = subprocess.run(
        [str(Path(sys.executable).parent / "lint-imports")],
        cwd=copy,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(copy), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode != 0
    assert reported in result.stdout
