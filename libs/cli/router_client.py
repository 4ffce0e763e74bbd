"""What `epd generate` and `epd transcribe` share: finding the router (an address, or the run
directory of a running `epd up`), its TLS CA and bearer token, asking it what the stack serves
(its `ServiceInfo`: the model, and whether it transcribes speech) so a command sent to the wrong
kind of stack is refused with the command to use instead, and streaming one request's reply to
stdout with a summary line on stderr."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from libs.client.generate import GenerationResult, generate, open_channel
from libs.contract.epd.v1 import generate_pb2, service_info_pb2, service_info_pb2_grpc
from libs.contract.validation import SPEECH_TRANSCRIPTION
from libs.launch import rundir
from libs.launch.stack import CLIENT_TOKEN, TLS_DIR

ADDRESS_FILE = "router.address"  # in the run directory, while `epd up` runs
DEFAULT_RUN_DIR = Path("var/run/stack")  # where `epd up` runs, and where its clients look
# Finish reasons as OpenAI clients and `vllm` print them, not the contract's enum names.
FINISH_REASONS = {
    "FINISH_REASON_STOP": "stop",
    "FINISH_REASON_LENGTH": "length",
    "FINISH_REASON_STOP_SEQUENCE": "stop (a --stop sequence)",
}


class UsageError(Exception):
    """The command line does not lead to a usable router (exit status 2)."""


@dataclass(frozen=True)
class RouterTarget:
    address: str
    tls_ca: bytes | None
    token: str | None


@dataclass(frozen=True)
class Served:
    """What the stack behind an address serves, as its ServiceInfo says. A router advertises its
    back ends' model once it has checked them (at its warm-up, which `epd up` turns on, or its
    first request); before that, or from a router older than this, `model` is empty: unknown."""

    model: str
    speech: bool
    timestamp_begin: int | None  # Whisper's first timestamp token, for `epd transcribe --timestamps`

    @classmethod
    def of(cls, info: service_info_pb2.ServiceInfo) -> Served:
        speech = SPEECH_TRANSCRIPTION in info.capabilities or info.HasField("transcription")
        begin = info.transcription.timestamp_begin_token_id if info.HasField("transcription") else None
        return cls(info.model.model_id, speech, begin)


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
        raise UsageError(
            f"no --address and no running `epd up` stack in {ns.run_dir} (start one with `epd up`, or give "
            "--run-dir DIR of the one that runs)"
        )
    if not ns.address and rundir.holder(ns.run_dir) is None and (ns.run_dir / rundir.LOCK_FILE).exists():
        raise UsageError(
            f"the stack of {ns.run_dir} is not running (its `epd up` was killed and left {address_file}); "
            "start it again with `epd up`"
        )
    try:
        tls_ca, token = client_security(ns)
    except OSError as exc:
        raise UsageError(str(exc)) from None
    if token and tls_ca is None:
        raise UsageError("a token is only sent over TLS; give --tls-ca")
    return RouterTarget(address, tls_ca, token)


def finish_reason(name: str) -> str:
    """`FINISH_REASON_LENGTH` -> `length`."""
    return FINISH_REASONS.get(name, name.removeprefix("FINISH_REASON_").lower() or "unknown")


async def served(channel: grpc.aio.Channel, timeout_s: float = 10.0) -> Served | None:
    """What the server at `channel` serves; None when it has no ServiceInfo service (not EPD).
    Raises grpc.aio.AioRpcError when it cannot be reached."""
    stub = service_info_pb2_grpc.ServiceInfoServiceStub(channel)
    try:
        response = await stub.GetServiceInfo(service_info_pb2.GetServiceInfoRequest(), timeout=timeout_s)
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
            return None
        raise
    return Served.of(response.info)


def unreachable(command: str, address: str, exc: grpc.aio.AioRpcError) -> str:
    details = exc.details() or ""
    why = "connection refused" if "refused" in details.lower() else details
    return f"{command}: cannot reach the router at {address}: {exc.code().name}: {why} (is its `epd up` running?)"


# (what the stack serves or None, the failed call) -> a line to add to the error, or None.
Hint = Callable[[Served | None, grpc.aio.AioRpcError], str | None]
# What the stack serves (None: not said) -> a refusal of the command before sending, or None.
Check = Callable[[Served | None], str | None]


@dataclass
class Reply:
    """Where the reply goes: `on_chunk(token_ids, text)` per streamed chunk, `end()` once done."""

    on_chunk: Callable[[list[int], str], None]
    end: Callable[[], None]


def plain_text() -> Reply:
    return Reply(lambda _ids, text: print(text, end="", flush=True), lambda: print())


def stream_to_stdout(
    command: str,
    target: RouterTarget,
    request: generate_pb2.GenerateRequest,
    timeout_s: float,
    first: str,
    *,
    check: Check | None = None,
    hint: Hint | None = None,
    reply: Callable[[Served | None], Reply] | None = None,
) -> int:
    """Ask the stack what it serves (`check` may refuse the command: exit 2), then print the reply
    as it streams, then `[id] N tokens, finish, <first> ms, total ms` on stderr; 0, or 1 with the
    status (and `hint`'s line) when the call failed."""

    async def run() -> int:
        async with open_channel(target.address, tls_ca=target.tls_ca, token=target.token) as channel:
            try:
                stack = await served(channel)
            except grpc.aio.AioRpcError as exc:
                print(unreachable(command, target.address, exc), file=sys.stderr)
                return 1
            refusal = check(stack) if check is not None else None
            if refusal is not None:
                print(f"{command}: {refusal}", file=sys.stderr)
                return 2
            out = (reply or (lambda _: plain_text()))(stack)
            try:
                result: GenerationResult = await generate(channel, request, timeout_s=timeout_s, on_chunk=out.on_chunk)
            except grpc.aio.AioRpcError as exc:
                print(f"\n{command}: {exc.code().name}: {exc.details()}", file=sys.stderr)
                if hint is not None:
                    with_info = stack if stack is not None and stack.model else await _served_or_none(channel)
                    if (line := hint(with_info, exc)) is not None:
                        print(f"{command}: {line}", file=sys.stderr)
                return 1
        out.end()
        print(
            f"[{result.request_id}] {result.completion_tokens} tokens, {finish_reason(result.finish_reason)}, "
            f"{first} {result.ttft_s * 1000:.1f} ms, total {result.total_s * 1000:.1f} ms",
            file=sys.stderr,
        )
        return 0

    return asyncio.run(run())


async def _served_or_none(channel: grpc.aio.Channel) -> Served | None:
    """Asked again after a failure: a router learns its back ends' model at its first request."""
    try:
        return await served(channel)
    except grpc.aio.AioRpcError:
        return None
