"""What the vLLM engines of the PD and prefill services share: the embedding reads into the
service's shared pool (before vLLM sees a request: see ec_connector.py) and the EC connector's
report of items it could not copy into vLLM's encoder cache (the next output of a request's
stream is the supervisor's `Engine.next`: it also ends when the engine fails)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

from libs.backends.settings import EngineSettings
from libs.backends.vllm.requests import RequestPlanner
from libs.backends.vllm.shared_pool import SlotDescriptor, slot_of
from libs.contract.epd.v1 import chat_pb2
from libs.contract.errors import error_for
from libs.contract.reasons import Reason, reason_if_gone
from libs.serving import convert
from libs.serving.embeddings import FetchedItems, fetch_encoded
from libs.serving.service_info import model_identity
from libs.serving.transport import Transport, transfer_config
from libs.transfer import TransferConfig


def reads_config(settings: EngineSettings, role: str) -> TransferConfig:
    """The service's transport settings (`--pool-mib`, `--ucx-*`, `--checksum`), its pool shared
    with vLLM's worker, which copies each item from there."""
    return dataclasses.replace(transfer_config(settings, role), shared_pool=True, huge_pages=False)


def embedding_reads(settings: EngineSettings, role: str, weights_digest: str) -> Transport:
    """The service's consumer of the encoders' embeddings. A read waiting on a slow encoder holds
    one transfer thread until its request's deadline: enough threads that a few such reads leave
    the others theirs (a waiting thread sleeps between polls)."""
    identity = model_identity(settings, weights_digest)
    return Transport(reads_config(settings, role), identity, produce=False, consume=True, threads=8)


async def read_items(
    reads: Transport,
    planner: RequestPlanner,
    request_id: str,
    messages: Sequence[chat_pb2.ChatMessage],
    uuids: Sequence[str],
    deadline: float | None,
) -> tuple[FetchedItems, dict[str, SlotDescriptor]]:
    """Every item of the request read into the shared pool under its deadline (the transfer's typed
    errors; the `embeddings.transfer` span and byte counter), and where each uuid's tensors lie.
    The caller releases the items once vLLM is done with the request."""
    specs = {spec.modality: spec for spec in planner.expected_specs()}
    fetched = await fetch_encoded(reads, messages, specs, deadline)
    read = [
        (index, uuid)
        for index, (uuid, part) in enumerate(zip(uuids, convert.media_parts(messages), strict=True))
        if not part.encoded.prefix_held  # held: read nothing, vLLM's prefix cache has it
    ]
    try:
        pool = reads.agent.pool
        slots = {
            uuid: slot_of(received, pool, key=uuid, request_id=request_id, item=index)
            for (index, uuid), received in zip(read, fetched.received, strict=True)
        }
    except BaseException:
        fetched.release()
        raise
    return fetched, slots


def raise_load_failure(path: Path) -> None:
    """The EC connector's report of items it could not copy into vLLM, as a typed error."""
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    import grpc

    code = getattr(grpc.StatusCode, str(report.get("code", "UNAVAILABLE")), grpc.StatusCode.UNAVAILABLE)
    if report.get("reason") == Reason.EMBEDDING_NEEDED:  # a held item past the prefix-cache hit
        raise error_for(code, str(report.get("message", "")), "items", reason=Reason.EMBEDDING_NEEDED)
    message = f"embeddings did not reach vLLM's encoder cache: {report.get('message', '')}"
    raise error_for(code, message, "items", reason=reason_if_gone(code, Reason.EMBEDDING_GONE))
