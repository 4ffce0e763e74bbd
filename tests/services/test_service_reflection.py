"""Every service of a real stack (router, encoders, prefill, decode) answers reflection clients:
each service it lists, the reflection services included, resolves to its schema over both
reflection protocols, as `grpcurl describe` needs."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from libs.launch.stack import Stack
from tests.support.reflection import PROTOCOLS, describe

pytestmark = pytest.mark.stack

ROLE_SERVICE = {
    "router": "epd.v1.GenerateService",
    "encoder-0": "epd.v1.EncoderService",
    "prefill": "epd.v1.PrefillService",
    "decode": "epd.v1.DecodeService",
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_every_service_of_a_stack_is_described(stacks: Callable[[str], Stack], protocol: str) -> None:
    stack = stacks("e/p/d")
    for name, service in ROLE_SERVICE.items():
        described = describe(stack.processes[name].address, protocol)
        assert described.get(service), (name, sorted(described))
        assert {"grpc.reflection.v1.ServerReflection", "epd.v1.ServiceInfoService"} <= set(described), name
