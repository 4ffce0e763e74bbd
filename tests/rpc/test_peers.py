"""Peer handshake against a real server: compatible peers pass and are cached; another contract
major, model, role or embedding spec is FAILED_PRECONDITION; a dead address is UNAVAILABLE."""

from __future__ import annotations

import asyncio

import pytest

from libs.contract import version
from libs.contract.epd.v1 import media_pb2, service_info_pb2, tensor_pb2
from libs.contract.errors import FailedPrecondition, Unavailable
from libs.contract.version import CONTRACT_MINOR
from libs.launch.process import free_port
from libs.rpc.peers import PeerChannels, check_embedding_specs
from libs.rpc.server import EpdServer, ServerOptions

pytestmark = pytest.mark.unit

MODEL = service_info_pb2.ModelIdentity(model_id="tiny-omni", revision="local", weights_digest="ab" * 32)
ENCODER = service_info_pb2.SERVICE_ROLE_ENCODER


def _spec(width: int) -> service_info_pb2.EmbeddingSpec:
    return service_info_pb2.EmbeddingSpec(
        modality=media_pb2.MODALITY_IMAGE, width=width, dtype=tensor_pb2.D_TYPE_FLOAT32
    )


class Peer:
    """Service info a test can change between calls."""

    def __init__(self) -> None:
        self.info = service_info_pb2.ServiceInfo(
            contract_version=version.current(),
            model=MODEL,
            role=ENCODER,
            instance_id="one",
            embedding_specs=[_spec(64)],
        )
        self.calls = 0

    def __call__(self) -> service_info_pb2.ServiceInfo:
        self.calls += 1
        return self.info


def test_handshake_checks_and_caches() -> None:
    async def scenario() -> None:
        peer = Peer()
        server = EpdServer(ServerOptions(), peer)
        await server.start()
        peers = PeerChannels(roles=[ENCODER], model=MODEL)
        try:
            info = await peers.info(server.address)
            assert info.instance_id == "one"
            await peers.info(server.address)
            await peers.info(server.address, instance_id="one")
            assert peer.calls == 1  # cached while the instance is unchanged

            peer.info.instance_id = "two"  # the peer restarted
            assert (await peers.info(server.address, instance_id="two")).instance_id == "two"
            assert peer.calls == 2

            # Tensor handles name the NIXL agent's incarnation, not the process's: no re-read for
            # each handle of the same agent (one per request), one when the agent is new.
            peer.info.transports.add(kind=tensor_pb2.TRANSPORT_KIND_NIXL).nixl.instance_id = "agent-a"
            await peers.info(server.address, refresh=True)
            for _ in range(5):
                await peers.info(server.address, instance_id="agent-a")
            assert peer.calls == 3
            peer.info.transports[0].nixl.instance_id = "agent-b"
            await peers.info(server.address, instance_id="agent-b")
            assert peer.calls == 4

            peer.info.contract_version.major = 2
            with pytest.raises(
                FailedPrecondition, match=rf"peer speaks 2\.{CONTRACT_MINOR}, this service speaks 1\.{CONTRACT_MINOR}"
            ):
                await peers.info(server.address, refresh=True)
            peer.info.contract_version.major = 1

            peer.info.model.weights_digest = "cd" * 32
            with pytest.raises(FailedPrecondition, match=r"serves tiny-omni@local \(weights cdcdcdcdcdcd\); this"):
                await peers.info(server.address, refresh=True)
            peer.info.model.CopyFrom(MODEL)

            other = PeerChannels(roles=[service_info_pb2.SERVICE_ROLE_DECODE])
            with pytest.raises(
                FailedPrecondition, match="role SERVICE_ROLE_ENCODER; expected one of SERVICE_ROLE_DECODE"
            ):
                await other.info(server.address)
            await other.close()

            gone = PeerChannels(roles=[ENCODER], timeout_s=1.0)
            with pytest.raises(Unavailable, match="unreachable"):
                await gone.info(f"127.0.0.1:{free_port()}")
            await gone.close()
        finally:
            await peers.close()
            await server.stop(0)

    asyncio.run(scenario())


def test_embedding_specs_must_match() -> None:
    info = Peer().info
    check_embedding_specs([_spec(64)], info, "enc:1")
    with pytest.raises(FailedPrecondition, match=r"width 64.*differs from ours \(width 128"):
        check_embedding_specs([_spec(128)], info, "enc:1")
    audio = service_info_pb2.EmbeddingSpec(modality=media_pb2.MODALITY_AUDIO, width=64, dtype=tensor_pb2.D_TYPE_FLOAT32)
    with pytest.raises(FailedPrecondition, match="does not encode MODALITY_AUDIO"):
        check_embedding_specs([audio], info, "enc:1")
