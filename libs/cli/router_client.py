"""What `epd generate` and `epd transcribe` share: finding the router (an address, or the run
directory of a running `epd up`), its TLS CA and bearer token, and streaming one request's reply
to stdout with a summary line on stderr."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from libs.client.generate import generate, open_channel
from libs.contract.epd.v1 import generate_pb2
from libs.launch.stack import CLIENT_TOKEN, TLS_DIR

ADDRESS_FILE = "router.address"  # in the run directory, while `epd up` runs
DEFAULT_RUN_DIR = Path("var/run/stack")  # where `epd up` runs, and where its clients look


class UsageError(Exception):
    """The command line does not lead to a usable router (exit status 2)."""


@dataclass(frozen=True)
class RouterTarget:
    address: str
    tls_ca: bytes | None
    token: str | None


def client_security(ns: argparse.Namespace) -> tuple[bytes | None, str | None]:
    """The router's CA and the bearer token: from flags / EPD_TOKEN, else from an `epd up --tls` run dir."""
    tls_dir: Path = ns.run_dir / TLS_DIR
    ca_path = ns.tls_ca or (tls_dir / "ca.pem" if not ns.address and (tls_dir / "ca.pem").exists() else None)
    token_path = ns.token_file or (tls_dir / CLIENT_TOKEN if ca_path and (tls_dir / CLIENT_TOKEN).exists() else None)
    token = os.environ.get("EPD_TOKEN") or (token_path.read_text().strip() if token_path else None)
    return (ca_path.read_bytes() if ca_path else None), token


def router_target(ns: argparse.Namespace) -> RouterTarget:
    """The router named by `--address`, `--run-dir`, `--tls-ca` and `--token-file`; UsageError if none."""
    address_file = ns.run_dir / ADDRESS_FILE
    address = ns.address or (address_file.read_text().strip() if address_file.exists() else "")
    if not address:
        raise UsageError(f"no --address and no running `epd up` stack in {ns.run_dir}")
    try:
        tls_ca, token = client_security(ns)
    except OSError as exc:
        raise UsageError(str(exc)) from None
    if token and tls_ca is None:
        raise UsageError("a token is only sent over TLS; give --tls-ca")
    return RouterTarget(address, tls_ca, token)


def stream_to_stdout(
    command: str, target: RouterTarget, request: generate_pb2.GenerateRequest, timeout_s: float, first: str
) -> int:
    """Print the reply's text as it streams, then `[id] N tokens, finish, <first> ms, total ms` on
    stderr; 0, or 1 with the status when the call failed."""

    async def run() -> int:
        import grpc

        async with open_channel(target.address, tls_ca=target.tls_ca, token=target.token) as channel:
            try:
                result = await generate(
                    channel, request, timeout_s=timeout_s, on_text=lambda t: print(t, end="", flush=True)
                )
            except grpc.aio.AioRpcError as exc:
                print(f"\n{command}: {exc.code().name}: {exc.details()}", file=sys.stderr)
                return 1
        print()
        print(
            f"[{result.request_id}] {result.completion_tokens} tokens, {result.finish_reason}, "
            f"{first} {result.ttft_s * 1000:.1f} ms, total {result.total_s * 1000:.1f} ms",
            file=sys.stderr,
        )
        return 0

    return asyncio.run(run())
