"""What the vLLM engines of the PD, prefill and decode services share: the encoders' agent metadata
(first-contact checked) and the EC connector's report of embeddings it could not read (the next
output of a request's stream is the supervisor's `Engine.next`: it also ends when the engine fails)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from libs.backends.vllm.requests import ItemDescriptor
from libs.contract.epd.v1 import service_info_pb2, tensor_pb2
from libs.contract.errors import Unavailable, error_for
from libs.contract.reasons import Reason, reason_if_gone
from libs.serving.transport import MetadataResolver
from libs.telemetry.stages import count_transfer
from libs.transfer import PeerUnavailable


class EncoderAgents:
    """The encoders' NIXL agent metadata for vLLM's worker, resolved (GetServiceInfo + model check)
    once per encoder incarnation."""

    def __init__(self, model: service_info_pb2.ModelIdentity) -> None:
        self._resolver = MetadataResolver(model)
        self._metadata: dict[tuple[str, str, str], Any] = {}  # (address, agent, incarnation) -> resolved

    def __call__(self, ref: tensor_pb2.NixlAgentRef) -> Any:
        key = (ref.producer_address, ref.agent_name, ref.instance_id)
        if key not in self._metadata:
            try:
                self._metadata[key] = self._resolver(ref)
            except PeerUnavailable as exc:
                raise Unavailable(f"encoder {ref.producer_address}: {exc}", reason=Reason.EMBEDDING_GONE) from None
        return self._metadata[key]

    def close(self) -> None:
        self._resolver.close()


def raise_load_failure(path: Path) -> None:
    """The EC connector's report of embeddings it could not read, as the transfer's typed error."""
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    import grpc

    code = getattr(grpc.StatusCode, str(report.get("code", "UNAVAILABLE")), grpc.StatusCode.UNAVAILABLE)
    message = f"embedding read failed in the vLLM worker: {report.get('message', '')}"
    raise error_for(code, message, "items", reason=reason_if_gone(code, Reason.EMBEDDING_GONE))


def count_embedding_bytes(items: dict[str, ItemDescriptor]) -> None:
    """The embeddings vLLM's worker read for a request (EC connector, over NIXL), in the same
    byte counter as the reference engine's reads."""
    if items:
        count_transfer(sum(item.nbytes for item in items.values()), transport="nixl", direction="encoder->prefill")
