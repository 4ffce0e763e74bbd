"""Golden wire vectors (proto/snapshots/v*/wire): the bytes each released minor wrote still parse and
mean the same to the current code, and the snapshot code reads what the current code writes."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from google.protobuf import descriptor_pool
from google.protobuf.message import Message

from libs.contract import validation
from libs.contract.epd.v1 import lease_pb2, media_pb2
from tests.support import samples

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _load_wirevectors() -> ModuleType:
    name = "epd_proto_wirevectors"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "proto" / "wirevectors.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


wv = _load_wirevectors()
SNAPSHOTS = wv.snapshots()
VECTORS = [(s, name) for s in SNAPSHOTS for name in wv.vector_names(s)]
V1_0 = next(s for s in SNAPSHOTS if s.name == "v1.0")


def _tampered_copy(tmp_path: Path) -> Any:
    """A copy of the v1.0 snapshot's wire directory to corrupt."""
    shutil.copytree(V1_0.wire, tmp_path / "v1.0" / "wire")
    return wv.Snapshot("v1.0", tmp_path / "v1.0")


def test_v1_0_has_a_vector_per_rpc_type() -> None:
    assert wv.vector_names(V1_0) == sorted(wv.rpc_types(V1_0.package))
    assert len(wv.vector_names(V1_0)) == 16
    assert "epd.v1.GetServiceInfoResponse" in wv.vector_names(V1_0)


@pytest.mark.parametrize("snapshot", SNAPSHOTS, ids=[s.name for s in SNAPSHOTS])
def test_vectors_are_what_the_builders_write(snapshot: Any) -> None:
    assert wv.write_problems(snapshot) == []


@pytest.mark.parametrize(("snapshot", "name"), VECTORS, ids=[f"{s.name}-{n}" for s, n in VECTORS])
def test_current_code_reads_the_vector_as_written(snapshot: Any, name: str) -> None:
    assert wv.read_problems(snapshot, name) == []


def test_current_validation_runs_on_every_request_vector() -> None:
    checked = {name for name in wv.vector_names(V1_0) if name.endswith("Request") and wv.validator(name) is not None}
    assert checked == {
        f"epd.v1.{n}"
        for n in (
            "GenerateRequest",
            "EncodeRequest",
            "PrefillRequest",
            "PrefillDecodeRequest",
            "DecodeRequest",
            "ReleaseLeasesRequest",
            "GetServiceInfoRequest",
        )
    }


def test_snapshot_code_is_a_separate_copy() -> None:
    snapshot_cls = wv.message_class(V1_0.package, "epd.v1.MediaItem")
    assert snapshot_cls is not media_pb2.MediaItem
    assert snapshot_cls.DESCRIPTOR.full_name == media_pb2.MediaItem.DESCRIPTOR.full_name
    assert snapshot_cls.DESCRIPTOR.file.pool is not descriptor_pool.Default()
    assert media_pb2.MediaItem.DESCRIPTOR.file.pool is descriptor_pool.Default()
    # The default pool still resolves epd.v1 names to the current code.
    assert descriptor_pool.Default().FindMessageTypeByName("epd.v1.MediaItem") is media_pb2.MediaItem.DESCRIPTOR


_CURRENT_REQUESTS = [
    samples.generate_request,
    samples.encode_request,
    samples.prefill_request,
    samples.prefill_decode_request,
    samples.decode_request,
    samples.paged_decode_request,
    samples.speech_encode_request,
    samples.speech_prefill_request,
    samples.speech_decode_request,
    samples.release_leases_request,
    samples.get_service_info_request,
]


@pytest.mark.parametrize("build", _CURRENT_REQUESTS, ids=[b.__name__ for b in _CURRENT_REQUESTS])
@pytest.mark.parametrize("snapshot", SNAPSHOTS, ids=[s.name for s in SNAPSHOTS])
def test_snapshot_code_reads_and_forwards_current_requests(snapshot: Any, build: Callable[[], Message]) -> None:
    current = build()
    old = wv.message_class(snapshot.package, current.DESCRIPTOR.full_name).FromString(current.SerializeToString())
    # An old peer that parses and re-serializes (e.g. a proxy) keeps fields it does not know.
    assert type(current).FromString(old.SerializeToString()) == current
    assert old.ListFields(), "the snapshot code read nothing"


# The checks do fail when they should.


def test_an_unknown_field_in_a_vector_is_reported(tmp_path: Path) -> None:
    snapshot = _tampered_copy(tmp_path)
    path = snapshot.wire / "epd.v1.ReleaseLeasesRequest.binpb"
    path.write_bytes(path.read_bytes() + b"\xb8\x06\x01")  # field 103, varint 1
    problems = wv.read_problems(snapshot, "epd.v1.ReleaseLeasesRequest")
    assert problems and "reads it differently from its .txtpb" in problems[0] and "\n+103: 1\n" in problems[0]


def test_a_different_meaning_is_reported(tmp_path: Path) -> None:
    snapshot = _tampered_copy(tmp_path)
    changed = lease_pb2.ReleaseLeasesRequest(lease_ids=["lease-0", "lease-1"], reason=lease_pb2.RELEASE_REASON_CONSUMED)
    (snapshot.wire / "epd.v1.ReleaseLeasesRequest.binpb").write_bytes(changed.SerializeToString())
    problems = wv.read_problems(snapshot, "epd.v1.ReleaseLeasesRequest")
    assert any("\n-reason: RELEASE_REASON_ABANDONED\n+reason: RELEASE_REASON_CONSUMED\n" in p for p in problems)
    assert any("differs from the .txtpb" in p for p in problems)


def test_unparseable_bytes_are_reported(tmp_path: Path) -> None:
    snapshot = _tampered_copy(tmp_path)
    (snapshot.wire / "epd.v1.GenerateRequest.binpb").write_bytes(b"\x0a\xff\xff")
    assert "cannot parse" in wv.read_problems(snapshot, "epd.v1.GenerateRequest")[0]


def test_tightened_validation_is_reported() -> None:
    stricter = validation.Limits(max_stop_sequences=1)
    problems = wv.read_problems(V1_0, "epd.v1.GenerateRequest", limits=stricter)
    assert len(problems) == 1 and "rejects a request v1.0 accepted" in problems[0] and "sampling.stop" in problems[0]


def test_stale_missing_and_edited_vectors_are_reported(tmp_path: Path) -> None:
    snapshot = _tampered_copy(tmp_path)
    (snapshot.wire / "epd.v1.DecodeResponse.txtpb").unlink()
    (snapshot.wire / "epd.v1.Gone.binpb").write_bytes(b"")
    edited = snapshot.wire / "epd.v1.PrefillResponse.binpb"
    edited.write_bytes(edited.read_bytes()[:-1] + b"\x00")
    assert wv.write_problems(snapshot) == [
        "v1.0: epd.v1.DecodeResponse.txtpb is not written; run proto/wirevectors.py write v1.0",
        "v1.0: epd.v1.Gone.binpb is stale (no builder makes it)",
        "v1.0: epd.v1.PrefillResponse.binpb differs from what the builders write",
    ]


def test_builders_that_miss_a_type_or_a_field_are_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    builders = wv.builders(V1_0)
    kept = [m for m in builders.vectors() if m.DESCRIPTOR.name != "GetStatsResponse"]
    monkeypatch.setattr(builders, "vectors", lambda: kept)
    problems = wv.write_problems(V1_0)
    assert "v1.0: no builder makes epd.v1.GetStatsResponse" in problems
    assert "v1.0: no vector sets epd.v1.TransferPoolStats.capacity_bytes" in problems
    assert "v1.0: no vector sets epd.v1.GetStatsResponse.requests_in_flight" in problems
