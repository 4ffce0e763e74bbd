"""Who may call what, over real loopback sockets: mutual TLS on internal servers, TLS + bearer
tokens on public ones (libs/rpc/security.py). Each case names who calls and what it must get."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from libs.contract import version
from libs.contract.epd.v1 import (
    encoder_pb2,
    encoder_pb2_grpc,
    generate_pb2,
    generate_pb2_grpc,
    generation_pb2,
    service_info_pb2,
    service_info_pb2_grpc,
)
from libs.rpc import security
from libs.rpc.certs import LocalCa, write_material
from libs.rpc.security import TlsMaterial, load_tokens
from libs.rpc.server import EpdServer, ServerOptions, channel_options, open_channel
from tests.support import samples

pytestmark = pytest.mark.unit

TOKEN = "t0ken-with-enough-entropy-0123456789"
CA = LocalCa.create("cluster CA")
OTHER_CA = LocalCa.create("somebody else's CA")


class Encoder(encoder_pb2_grpc.EncoderServiceServicer):
    async def Encode(self, request: encoder_pb2.EncodeRequest, context: Any) -> encoder_pb2.EncodeResponse:
        return encoder_pb2.EncodeResponse()


class Generate(generate_pb2_grpc.GenerateServiceServicer):
    async def Generate(self, request: Any, context: Any) -> AsyncIterator[generate_pb2.GenerateResponse]:
        yield generate_pb2.GenerateResponse(chunk=generation_pb2.TokenChunk(token_ids=[1]))


def _info() -> service_info_pb2.ServiceInfo:
    return service_info_pb2.ServiceInfo(contract_version=version.current(), role=service_info_pb2.SERVICE_ROLE_ENCODER)


async def _serving(public: bool, tokens: frozenset[str] = frozenset()) -> EpdServer:
    role = "router" if public else "encoder"
    server = EpdServer(ServerOptions(tls=CA.issue(role), public=public, tokens=tokens), _info)
    if public:
        server.add(generate_pb2_grpc.add_GenerateServiceServicer_to_server, Generate(), "epd.v1.GenerateService")
    else:
        server.add(encoder_pb2_grpc.add_EncoderServiceServicer_to_server, Encoder(), "epd.v1.EncoderService")
    await server.start()
    return server


def _channel(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.aio.Channel:
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=channel_options())
    return grpc.aio.secure_channel(address, credentials, options=channel_options())


def _trusting(ca: LocalCa, material: TlsMaterial) -> TlsMaterial:
    """A valid certificate whose holder trusts another CA (so it refuses the server)."""
    return TlsMaterial(ca.pem, material.cert, material.key)


def _mutual(material: TlsMaterial) -> grpc.ChannelCredentials:
    return security.channel_credentials(material)


async def _encode(channel: grpc.aio.Channel) -> grpc.StatusCode:
    try:
        await encoder_pb2_grpc.EncoderServiceStub(channel).Encode(samples.encode_request(), timeout=5)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def _generate(channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...] = ()) -> tuple[Any, str]:
    try:
        async for _ in generate_pb2_grpc.GenerateServiceStub(channel).Generate(
            generate_pb2.GenerateRequest(), timeout=5, metadata=metadata
        ):
            pass
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def _run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(scenario())


# Who calls an internal server (encoder) and what it gets.
INTERNAL_CASES: dict[str, tuple[Callable[[], grpc.ChannelCredentials | None], grpc.StatusCode]] = {
    "plaintext client": (lambda: None, grpc.StatusCode.UNAVAILABLE),
    "TLS, no client certificate": (lambda: security.client_credentials(CA.pem), grpc.StatusCode.UNAVAILABLE),
    "certificate from another CA": (lambda: _mutual(OTHER_CA.issue("router")), grpc.StatusCode.UNAVAILABLE),
    "trusts another CA": (lambda: _mutual(_trusting(OTHER_CA, CA.issue("router"))), grpc.StatusCode.UNAVAILABLE),
    "client certificate from the cluster CA": (lambda: _mutual(CA.issue("client")), grpc.StatusCode.PERMISSION_DENIED),
    "service certificate from the cluster CA": (lambda: _mutual(CA.issue("router")), grpc.StatusCode.OK),
}


@pytest.mark.parametrize("who", list(INTERNAL_CASES))
def test_internal_server_accepts_only_service_certificates_of_the_cluster_ca(who: str) -> None:
    credentials, expected = INTERNAL_CASES[who]

    async def scenario() -> None:
        server = await _serving(public=False)
        try:
            async with _channel(server.address, credentials()) as channel:
                assert await _encode(channel) == expected
        finally:
            await server.stop(0)

    _run(scenario)


def test_permission_denied_names_the_role_and_the_api() -> None:
    async def scenario() -> None:
        server = await _serving(public=False)
        try:
            async with _channel(server.address, _mutual(CA.issue("client"))) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as denied:
                    await encoder_pb2_grpc.EncoderServiceStub(channel).Encode(samples.encode_request(), timeout=5)
                assert "/epd.v1.EncoderService/Encode is an internal API" in (denied.value.details() or "")
                assert "'client'" in (denied.value.details() or "")
                # Health stays open to whoever completed the handshake (probes, tooling).
                health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert health.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await server.stop(0)

    _run(scenario)


TOKEN_CASES = {
    "no token": ((), grpc.StatusCode.UNAUTHENTICATED, "missing credentials"),
    "wrong token": ((("authorization", "Bearer not-the-token-01234"),), grpc.StatusCode.UNAUTHENTICATED, "unknown"),
    "not a bearer token": ((("authorization", f"Basic {TOKEN}"),), grpc.StatusCode.UNAUTHENTICATED, "missing"),
    "right token": ((("authorization", f"Bearer {TOKEN}"),), grpc.StatusCode.OK, ""),
}


@pytest.mark.parametrize("who", list(TOKEN_CASES))
def test_public_server_requires_a_known_bearer_token(who: str) -> None:
    metadata, expected, says = TOKEN_CASES[who]

    async def scenario() -> None:
        server = await _serving(public=True, tokens=frozenset({TOKEN}))
        try:
            async with _channel(server.address, security.client_credentials(CA.pem)) as channel:
                code, details = await _generate(channel, metadata)
                assert code == expected and says in details, (code, details)
                # First-contact reads need no token.
                info = await service_info_pb2_grpc.ServiceInfoServiceStub(channel).GetServiceInfo(
                    service_info_pb2.GetServiceInfoRequest(), timeout=5
                )
                assert info.info.role == service_info_pb2.SERVICE_ROLE_ENCODER
        finally:
            await server.stop(0)

    _run(scenario)


def test_public_server_refuses_plaintext_and_clients_trusting_another_ca() -> None:
    async def scenario() -> None:
        server = await _serving(public=True, tokens=frozenset({TOKEN}))
        try:
            for credentials in (None, security.client_credentials(OTHER_CA.pem)):
                async with _channel(server.address, credentials) as channel:
                    code, _ = await _generate(channel, (("authorization", f"Bearer {TOKEN}"),))
                    assert code == grpc.StatusCode.UNAVAILABLE
        finally:
            await server.stop(0)

    _run(scenario)


def test_client_library_sends_the_token_over_tls_only() -> None:
    from libs.client.generate import open_channel as client_channel

    async def scenario() -> None:
        server = await _serving(public=True, tokens=frozenset({TOKEN}))
        try:
            async with client_channel(server.address, tls_ca=CA.pem, token=TOKEN) as channel:
                assert (await _generate(channel))[0] == grpc.StatusCode.OK
        finally:
            await server.stop(0)
        with pytest.raises(ValueError, match="only sent over TLS"):
            client_channel(server.address, token=TOKEN)

    _run(scenario)


def test_process_tls_identity_is_used_by_every_peer_channel() -> None:
    """A service configured with its certificate reaches internal peers with `open_channel`."""

    async def scenario() -> None:
        server = await _serving(public=False)
        security.configure(CA.issue("prefill"))
        try:
            async with open_channel(server.address) as channel:
                assert await _encode(channel) == grpc.StatusCode.OK
        finally:
            security.configure(None)
            await server.stop(0)

    _run(scenario)


def test_tokens_need_tls_and_enough_length(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="need TLS"):
        EpdServer(ServerOptions(public=True, tokens=frozenset({TOKEN})), _info)
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# clients\n{TOKEN}\n\n  other-token-0123456789abcdef  # ci\n")
    assert load_tokens(tokens, ["inline-token-0123456789"]) == {
        TOKEN,
        "other-token-0123456789abcdef",
        "inline-token-0123456789",
    }
    with pytest.raises(ValueError, match="shorter than 16"):
        load_tokens(None, ["short"])


def test_certificates_written_for_a_stack_load_back(tmp_path: Path) -> None:
    ca, cert, key = write_material(CA.issue("decode"), tmp_path, "decode")
    assert key.stat().st_mode & 0o077 == 0  # the private key is readable by its owner only
    loaded = TlsMaterial.from_settings(ca, cert, key)
    assert loaded is not None and loaded.ca == CA.pem
    assert TlsMaterial.from_settings(None, None, None) is None
    with pytest.raises(ValueError, match="together"):
        TlsMaterial.from_settings(ca, None, None)
