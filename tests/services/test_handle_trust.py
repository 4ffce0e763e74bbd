"""Prefill does not trust the handles it is given: with real encoder and prefill processes, a
handle whose checksums were left out is refused (the encoder advertises that it attaches them:
INVALID_ARGUMENT), a handle of a released lease and a handle with live regions but a made-up lease
id are refused by the lease stamp check (NOT_FOUND, naming the lease); the owner of the live lease
is unaffected and prefill keeps serving."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest

from libs.contract.epd.v1 import (
    encoder_pb2,
    encoder_pb2_grpc,
    layout_pb2,
    lease_pb2,
    lease_pb2_grpc,
    media_pb2,
    prefill_pb2,
    prefill_pb2_grpc,
    service_info_pb2,
    service_info_pb2_grpc,
    tensor_pb2,
)
from libs.launch.stack import Stack
from libs.model.media import synthetic
from libs.transfer.stamp import CAPABILITY, CHECKSUMS_CAPABILITY
from tests.support.stacks import wait_pools_empty

pytestmark = pytest.mark.stack


def _encode(encoder: str, seed: int, transport: int = tensor_pb2.TRANSPORT_KIND_NIXL) -> layout_pb2.EncodedMedia:
    image = media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=synthetic.png_bytes(60, 90, seed=seed))
    with grpc.insecure_channel(encoder) as channel:
        reply = encoder_pb2_grpc.EncoderServiceStub(channel).Encode(
            encoder_pb2.EncodeRequest(
                request_id=f"trust-{seed}",
                items=[encoder_pb2.EncodeItem(item_index=0, media=image)],
                accepted_transports=[transport],
            ),
            timeout=60,
        )
    return reply.items[0]


def _prefill(prefill: str, encoded: layout_pb2.EncodedMedia) -> prefill_pb2.PrefillResponse:
    request = prefill_pb2.PrefillRequest(request_id="trust", accepted_kv_transports=[tensor_pb2.TRANSPORT_KIND_NIXL])
    request.sampling.max_tokens = 1
    message = request.messages.add(role=1)
    message.parts.add(encoded=encoded)
    message.parts.add(text="what is in this image")
    with grpc.insecure_channel(prefill) as channel:
        response: prefill_pb2.PrefillResponse = prefill_pb2_grpc.PrefillServiceStub(channel).Prefill(
            request, timeout=60
        )
        return response


def _release(encoder: str, lease_id: str) -> int:
    with grpc.insecure_channel(encoder) as channel:
        reply = lease_pb2_grpc.LeaseServiceStub(channel).ReleaseLeases(
            lease_pb2.ReleaseLeasesRequest(lease_ids=[lease_id], reason=lease_pb2.RELEASE_REASON_ABANDONED), timeout=5
        )
    return int(reply.released_count)


@pytest.mark.timeout(180)
def test_prefill_refuses_handles_that_name_no_live_lease(stacks: Callable[[str], Stack]) -> None:
    stack = stacks("e/p/d")
    encoder = stack.processes["encoder-0"].address
    prefill = stack.processes["prefill"].address
    with grpc.insecure_channel(encoder) as channel:
        info = service_info_pb2_grpc.ServiceInfoServiceStub(channel).GetServiceInfo(
            service_info_pb2.GetServiceInfoRequest(), timeout=10
        )
    # What tells prefill to check stamps and to require checksums.
    assert {CAPABILITY, CHECKSUMS_CAPABILITY} <= set(info.info.capabilities)

    released = _encode(encoder, seed=11)
    assert _release(encoder, released.embeddings.lease_id) == 1
    # Released: the slot's stamp was wiped (and the slot poisoned), whatever the handle claims.
    with pytest.raises(grpc.RpcError) as caught:
        _prefill(prefill, released)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert f"{released.embeddings.lease_id} is not held" in (caught.value.details() or "")
    # Its checksums left out: refused before any read.
    for desc in released.embeddings.tensors:
        desc.ClearField("checksum")
    with pytest.raises(grpc.RpcError) as caught:
        _prefill(prefill, released)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "lack the checksum" in (caught.value.details() or "")

    # Live regions, made-up lease id (checksums copied from the real handle, so they match).
    live = _encode(encoder, seed=12)
    forged = layout_pb2.EncodedMedia()
    forged.CopyFrom(live)
    forged.embeddings.lease_id = f"{live.embeddings.lease_id[:8]}-madeup"
    with pytest.raises(grpc.RpcError) as caught:
        _prefill(prefill, forged)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert "madeup is not held" in (caught.value.details() or "")

    # The live lease was not consumed by the refused read: its owner still prefills with it.
    assert _prefill(prefill, live).first_chunk.token_ids
    wait_pools_empty(stack)


@pytest.mark.timeout(120)
def test_prefill_without_tls_refuses_inline_handles(stacks: Callable[[str], Stack]) -> None:
    """Tensor bytes inside a request would let any caller inject embeddings: a prefill without TLS
    (and without --accept-inline-tensors) refuses an INLINE handle with PERMISSION_DENIED naming
    it (docs/security.md), not INTERNAL, and keeps serving."""
    stack = stacks("e/p/d")
    encoder = stack.processes["encoder-0"].address
    prefill = stack.processes["prefill"].address
    inline = _encode(encoder, seed=13, transport=tensor_pb2.TRANSPORT_KIND_INLINE)
    assert inline.embeddings.transport == tensor_pb2.TRANSPORT_KIND_INLINE
    with pytest.raises(grpc.RpcError) as caught:
        _prefill(prefill, inline)
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED, caught.value.details()
    assert f"inline handle {inline.embeddings.lease_id}" in (caught.value.details() or "")
    assert _prefill(prefill, _encode(encoder, seed=14)).first_chunk.token_ids
    wait_pools_empty(stack)
