"""Contract 1.7's `ServiceInfo.max_running_requests` across minors: a 1.6 decode's ServiceInfo (its
golden vector) reads to 1.7 code as advertising nothing, so a router holds no prefill back for it
(as before 1.7); a 1.6 peer reads a 1.7 ServiceInfo with every 1.6 field intact and the new one
as an unknown number it ignores."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import text_format

from libs.contract.epd.v1 import service_info_pb2
from libs.contract.snapshots.v1_6.epd.v1 import service_info_pb2 as service_info_v1_6
from tests.support.router_harness import Harness

pytestmark = pytest.mark.unit

WIRE = Path(__file__).resolve().parents[2] / "proto" / "snapshots"


def _info(version: str) -> service_info_pb2.ServiceInfo:
    wire = (WIRE / version / "wire" / "epd.v1.GetServiceInfoResponse.binpb").read_bytes()
    return service_info_pb2.GetServiceInfoResponse.FromString(wire).info


def test_a_1_6_decode_advertises_nothing_and_lifts_the_routers_bound() -> None:
    old, new = _info("v1.6").max_running_requests, _info("v1.7").max_running_requests
    assert old == 0 and new == 16
    h = Harness()
    h.checks.running = lambda address: old
    assert h.router._clients._decode_capacity() >= 1 << 30
    h.checks.running = lambda address: new  # a 1.7 decode: its bound
    assert h.router._clients._decode_capacity() == 16


def test_a_1_6_peer_reads_a_1_7_service_info_with_the_new_field_unknown() -> None:
    new = _info("v1.7")
    old = service_info_v1_6.ServiceInfo.FromString(new.SerializeToString())
    assert old.model.model_id == new.model.model_id and list(old.capabilities) == list(new.capabilities)
    shown = text_format.MessageToString(old, print_unknown_fields=True)
    assert {line.split(":")[0] for line in shown.splitlines() if line[:1].isdigit()} == {"11"}
