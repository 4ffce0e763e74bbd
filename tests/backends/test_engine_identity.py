"""Engines are advertised as `engine.<name>` capabilities; the router refuses a prefill/decode pair
of different engines at first contact, naming both (their KV layouts differ)."""

from __future__ import annotations

import pytest

from libs.backends.engines import capability, engine_capabilities, engine_of
from libs.contract.epd.v1 import service_info_pb2
from libs.contract.errors import FailedPrecondition
from services.router.handshake import check_engine_pair

pytestmark = pytest.mark.unit


def _info(*capabilities: str) -> service_info_pb2.ServiceInfo:
    return service_info_pb2.ServiceInfo(capabilities=list(capabilities))


def test_capability_round_trip() -> None:
    assert engine_of(_info(*engine_capabilities("vllm", ["admission.priority"]))) == "vllm"
    assert engine_of(_info("admission.priority")) == "reference"  # peers from before engines were named
    with pytest.raises(ValueError):
        capability("tensorrt")


def test_mismatched_engine_pair_is_refused_naming_both() -> None:
    check_engine_pair(_info(capability("vllm")), "p:1", _info(capability("vllm")), "d:2")
    with pytest.raises(FailedPrecondition) as err:
        check_engine_pair(_info(capability("vllm")), "p:1", _info(), "d:2")
    assert "prefill p:1 runs the vllm engine" in str(err.value) and "decode d:2 the reference engine" in str(err.value)
