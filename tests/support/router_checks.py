"""First-contact checks (`services.router.stubs.Checks`) that pass every peer without a
handshake, for router tests without services; a test that wants one refused or gone replaces the
hook it needs (`on_encoder`, `on_prefill`, `on_decode`, `honoring`, `cache_of`, `running`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from libs.contract.epd.v1 import service_info_pb2


async def _passes(*_: str | None) -> None:
    return None


class PassingChecks:
    def __init__(self, info: service_info_pb2.ServiceInfo | None = None) -> None:
        self.info = info or service_info_pb2.ServiceInfo()  # what `backend()` answers
        self.on_encoder: Callable[[str, str | None], Awaitable[None]] = _passes
        self.on_prefill: Callable[[str], Awaitable[None]] = _passes
        self.on_decode: Callable[[str, str], Awaitable[None]] = _passes
        self.honoring: Callable[[str, str], bool] = lambda address, capability: False
        self.cache_of: Callable[[str], service_info_pb2.EncoderCacheInfo | None] = lambda address: None
        self.running: Callable[[str], int | None] = lambda address: None  # first contact not made

    async def backend(self) -> service_info_pb2.ServiceInfo:
        return self.info

    async def encoder(self, address: str, instance_id: str | None = None) -> None:
        await self.on_encoder(address, instance_id)

    async def prefill(self, address: str) -> None:
        await self.on_prefill(address)

    async def decode(self, address: str, prefill_address: str) -> None:
        await self.on_decode(address, prefill_address)

    def honors(self, address: str, capability: str) -> bool:
        return self.honoring(address, capability)

    def encoder_cache(self, address: str) -> service_info_pb2.EncoderCacheInfo | None:
        return self.cache_of(address)

    def max_running(self, address: str) -> int | None:
        return self.running(address)
