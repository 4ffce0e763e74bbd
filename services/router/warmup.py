"""First contact before traffic: the router sends one tiny image request through every encoder and
the prefill/decode (or PD) backend when it starts, so that no client request pays for first-contact
work: the peer handshakes (`GetServiceInfo`), HTTP/2 connections, each consumer's NIXL metadata
exchange and connection to each producer (encoder -> prefill/PD, prefill -> decode: the first READ's
cost), and the first run of each code path. Bounded in time; a backend that is not up
or refuses is logged and skipped (the request path handles it as before)."""

from __future__ import annotations

import struct
import time
import uuid
import zlib
from collections.abc import Sequence

import grpc
import structlog

from libs.contract.epd.v1 import chat_pb2, encoder_pb2, generate_pb2, media_pb2, sampling_pb2, tensor_pb2
from libs.contract.errors import EpdError
from libs.telemetry.stages import phase
from services.router.failover import remaining
from services.router.leases import Leases, RequestState
from services.router.stages import StageClients

_log = structlog.get_logger(__name__)


def tiny_png(width: int = 64, height: int = 64) -> bytes:
    """A mid-grey RGB PNG, built with zlib alone (the router imports no image library)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\0" + b"\x80" * (3 * width) for _ in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


async def warm_up(
    clients: StageClients, leases: Leases, addresses: Sequence[str], image: bytes, timeout_s: float = 30.0
) -> int:
    """One tiny image request per encoder in `addresses`, through prefill and decode (E/P/D) or PD,
    outside any client trace, and as many more (encoders in turn) as every prefill, decode or PD
    member needs to see one (the pools pick each member in turn); returns the requests that
    succeeded."""
    stubs, pools = clients.stubs, clients.stages
    warmed = 0
    media = media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=image)
    stages = [p.size for p in (pools.prefill, pools.decode, pools.pd) if p is not None]
    rounds = max([len(addresses), *stages]) if addresses else 0
    for address in (addresses[i % len(addresses)] for i in range(rounds)):
        state = RequestState(f"warm-up-{uuid.uuid4().hex[:8]}")
        deadline = time.monotonic() + timeout_s
        try:
            with phase("router.warm_up", **{"epd.encoder": address}):
                await stubs.checks.backend()
                await stubs.checks.encoder(address, None)
                job = encoder_pb2.EncodeRequest(
                    request_id=state.request_id,
                    items=[encoder_pb2.EncodeItem(item_index=0, media=media)],
                    accepted_transports=[tensor_pb2.TRANSPORT_KIND_NIXL],
                )
                reply = await stubs.encoder(address).Encode(job, timeout=remaining(deadline))
                state.hold(reply.items[0].embeddings)
                parts = [chat_pb2.ContentPart(encoded=reply.items[0]), chat_pb2.ContentPart(text="warm-up")]
                request = generate_pb2.GenerateRequest(
                    request_id=state.request_id,
                    messages=[chat_pb2.ChatMessage(role=chat_pb2.CHAT_ROLE_USER, parts=parts)],
                    sampling=sampling_pb2.SamplingParams(max_tokens=2),
                )
                async for _ in clients.prefill_and_decode(list(request.messages), request, state, deadline):
                    pass
            warmed += 1
        except (EpdError, grpc.aio.AioRpcError, IndexError) as exc:
            _log.warning("warm-up failed; first contact waits for traffic", encoder=address, error=str(exc)[:200])
        finally:
            await leases.release_all(state)
    return warmed
