"""Peer handshake: every consumer reads a producer's `ServiceInfo` at first contact and checks it.

`PeerChannels` keeps one channel per peer address and that peer's checked `ServiceInfo`. It is
re-read when a handle names a different `instance_id` than the cached one (the peer restarted) or
on demand. A peer that cannot be reached is UNAVAILABLE; one that speaks another contract major,
serves another model, has an unexpected role, or advertises different embedding specs is
FAILED_PRECONDITION, with both sides named.

Called by the router (for encoders, prefill, decode) and by prefill / decode (for the producers
whose tensors they read).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import grpc

from libs.contract import version
from libs.contract.epd.v1 import media_pb2, service_info_pb2, service_info_pb2_grpc, tensor_pb2
from libs.contract.errors import FailedPrecondition, Unavailable
from libs.rpc.server import open_channel


def _model(m: service_info_pb2.ModelIdentity) -> str:
    return f"{m.model_id}@{m.revision} (weights {m.weights_digest[:12] or '?'})"


def check_peer(
    info: service_info_pb2.ServiceInfo,
    address: str,
    *,
    roles: Iterable[int] | None,
    model: service_info_pb2.ModelIdentity | None = None,
) -> None:
    """Raise FailedPrecondition when the peer at `address` cannot serve us (`roles` None: any role)."""
    problem = version.incompatibility(info.contract_version)
    if problem:
        raise FailedPrecondition(f"peer {address}: {problem}")
    allowed = set(roles) if roles is not None else {info.role}
    if info.role not in allowed:
        names = ", ".join(sorted(service_info_pb2.ServiceRole.Name(r) for r in allowed))  # type: ignore[arg-type]
        raise FailedPrecondition(
            f"peer {address} has role {service_info_pb2.ServiceRole.Name(info.role)}; expected one of {names}"
        )
    if model is not None and (info.model.model_id, info.model.weights_digest) != (model.model_id, model.weights_digest):
        raise FailedPrecondition(f"peer {address} serves {_model(info.model)}; this service serves {_model(model)}")


def check_embedding_specs(
    expected: Iterable[service_info_pb2.EmbeddingSpec], info: service_info_pb2.ServiceInfo, address: str
) -> None:
    """Raise FailedPrecondition when an encoder's advertised specs differ from what we consume."""
    theirs = {spec.modality: spec for spec in info.embedding_specs}
    for ours in expected:
        name = media_pb2.Modality.Name(ours.modality)
        spec = theirs.get(ours.modality)
        if spec is None:
            raise FailedPrecondition(f"peer {address} does not encode {name}")
        mine = (ours.width, ours.dtype, sorted((t.name, t.width, t.dtype) for t in ours.extra_tensors))
        peer = (spec.width, spec.dtype, sorted((t.name, t.width, t.dtype) for t in spec.extra_tensors))
        if mine != peer:
            raise FailedPrecondition(
                f"peer {address} {name} embedding spec (width {spec.width}, {tensor_pb2.DType.Name(spec.dtype)}, "
                f"{len(spec.extra_tensors)} extra) differs from ours (width {ours.width}, "
                f"{tensor_pb2.DType.Name(ours.dtype)}, {len(ours.extra_tensors)} extra)"
            )


def _same_incarnation(info: service_info_pb2.ServiceInfo, instance_id: str | None) -> bool:
    """Whether `instance_id` names the incarnation `info` describes: the process's own id, or the
    id of one of its NIXL agents (what tensor handles carry). None: any."""
    if instance_id is None or instance_id == info.instance_id:
        return True
    return any(t.HasField("nixl") and t.nixl.instance_id == instance_id for t in info.transports)


class PeerChannels:
    """Channels to peers and their checked service info (use from one event loop)."""

    def __init__(
        self,
        *,
        roles: Iterable[int] | None = None,
        model: service_info_pb2.ModelIdentity | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        self._roles = tuple(roles) if roles is not None else None
        self._model = model
        self._timeout_s = timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._infos: dict[str, service_info_pb2.ServiceInfo] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def channel(self, address: str) -> grpc.aio.Channel:
        """The (shared) channel to `address`."""
        if address not in self._channels:
            self._channels[address] = open_channel(address)
        return self._channels[address]

    async def info(
        self, address: str, *, instance_id: str | None = None, refresh: bool = False
    ) -> service_info_pb2.ServiceInfo:
        """The checked service info of `address`; re-read when `instance_id` (the process's or its
        NIXL agent's, as a tensor handle names it) is not the cached incarnation's."""
        cached = self._infos.get(address)
        if cached is not None and not refresh and _same_incarnation(cached, instance_id):
            return cached
        async with self._locks.setdefault(address, asyncio.Lock()):
            cached = self._infos.get(address)
            if cached is not None and not refresh and _same_incarnation(cached, instance_id):
                return cached
            stub = service_info_pb2_grpc.ServiceInfoServiceStub(self.channel(address))
            try:
                reply = await stub.GetServiceInfo(
                    service_info_pb2.GetServiceInfoRequest(caller_contract_version=version.current()),
                    timeout=self._timeout_s,
                )
            except grpc.aio.AioRpcError as exc:
                self._infos.pop(address, None)
                raise Unavailable(f"peer {address} unreachable: {exc.code().name} {exc.details()}") from None
            check_peer(reply.info, address, roles=self._roles, model=self._model)
            self._infos[address] = reply.info
            return reply.info

    def cached(self, address: str) -> service_info_pb2.ServiceInfo | None:
        """The checked info of `address`, if it was read."""
        return self._infos.get(address)

    def forget(self, address: str) -> None:
        """Drop the cached info of `address` (e.g. after it failed); the next call re-reads it."""
        self._infos.pop(address, None)

    async def drop(self, address: str) -> None:
        """Close the channel to a peer that left (a later call to it opens a new one)."""
        channel = self._channels.pop(address, None)
        self._infos.pop(address, None)
        self._locks.pop(address, None)
        if channel is not None:
            await channel.close(1.0)  # a moment for calls still on it (lease releases)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close(None)
        self._channels.clear()
        self._infos.clear()
