"""A whole E/P/D stack under mutual TLS with client tokens (`epd up --tls`): every hop (router ->
encoder / prefill / decode, prefill and decode -> producers' ServiceInfo for NIXL metadata, lease
releases) runs over TLS with service certificates, the golden requests still equal generate(), and
the doors stay shut to anyone without the right credentials."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from libs.client.generate import generate, open_channel
from libs.contract.epd.v1 import encoder_pb2_grpc
from libs.launch.process import ROOT
from libs.launch.stack import CLIENT_TOKEN, Stack, StackSpec
from libs.rpc import security
from libs.rpc.certs import LocalCa
from tests.support import samples
from tests.support.golden import request_for
from tests.support.stacks import MIXES

pytestmark = pytest.mark.stack

MIX_NAMES = ["image", "audio_image", "video"]


@pytest.fixture(scope="module")
def tls_stack(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    run_dir = tmp_path_factory.mktemp("tls-stack")
    stack = Stack(StackSpec(layout="e/p/d", encoders=1, model=model_path, run_dir=run_dir, tls=True))
    stack.up()
    try:
        yield stack
    finally:
        statuses = stack.down()
        assert all(code == 0 for code in statuses.values()), statuses


def _credentials(stack: Stack) -> tuple[bytes, str]:
    return (stack.tls_dir / "ca.pem").read_bytes(), (stack.tls_dir / CLIENT_TOKEN).read_text().strip()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_golden_requests_over_mutual_tls(tls_stack: Stack, expected: dict[str, list[int]]) -> None:
    ca, token = _credentials(tls_stack)

    async def run() -> dict[str, list[int]]:
        async with open_channel(tls_stack.address, tls_ca=ca, token=token) as channel:
            return {
                name: (await generate(channel, request_for(MIXES[name]), timeout_s=120)).token_ids for name in MIX_NAMES
            }

    assert asyncio.run(run()) == {name: expected[name] for name in MIX_NAMES}


@pytest.mark.slow
def test_stack_refuses_callers_without_credentials(tls_stack: Stack) -> None:
    ca, token = _credentials(tls_stack)
    request = request_for(MIXES["text"])

    async def code_of(channel: grpc.aio.Channel) -> grpc.StatusCode:
        try:
            await generate(channel, request, timeout_s=10)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK

    async def run() -> list[grpc.StatusCode]:
        codes = []
        async with grpc.aio.insecure_channel(tls_stack.address) as plaintext:
            codes.append(await code_of(plaintext))
        async with open_channel(tls_stack.address, tls_ca=ca) as no_token:
            codes.append(await code_of(no_token))
        async with open_channel(tls_stack.address, tls_ca=ca, token=token + "x") as wrong_token:
            codes.append(await code_of(wrong_token))
        async with open_channel(tls_stack.address, tls_ca=ca, token=token) as right:
            codes.append(await code_of(right))
        # The encoder's internal API: a certificate of another CA never gets through the handshake.
        stranger = security.channel_credentials(LocalCa.create().issue("router"))
        async with grpc.aio.secure_channel(tls_stack.processes["encoder-0"].address, stranger) as channel:
            try:
                await encoder_pb2_grpc.EncoderServiceStub(channel).Encode(samples.encode_request(), timeout=10)
                codes.append(grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as exc:
                codes.append(exc.code())
        return codes

    assert asyncio.run(run()) == [
        grpc.StatusCode.UNAVAILABLE,  # plaintext against TLS
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.OK,
        grpc.StatusCode.UNAVAILABLE,  # handshake refused
    ]


@pytest.mark.slow
def test_cli_generate_finds_the_stack_credentials(tls_stack: Stack) -> None:
    ca = tls_stack.tls_dir / "ca.pem"
    token = tls_stack.tls_dir / CLIENT_TOKEN
    base = [sys.executable, "-m", "libs.cli", "generate", "--address", tls_stack.address, "--max-tokens", "4"]
    ok = subprocess.run(
        [*base, "--tls-ca", str(ca), "--token-file", str(token), "hello"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    assert "4 tokens" in ok.stderr
    refused = subprocess.run(
        [*base, "--tls-ca", str(ca), "hello"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
