"""gRPC adapter of the router: `GenerateService` over `Router`, the process entry point, and with
`--openai-port` the OpenAI door beside it (libs/door/in_process.py: the door component, handed the
router core)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from libs.cache.store import MooncakeStoreClient, StoreConfig
from libs.config import ClientAuthSettings, CommonSettings, setting
from libs.contract import version
from libs.contract.epd.v1 import (
    decode_pb2_grpc,
    encoder_pb2_grpc,
    generate_pb2,
    generate_pb2_grpc,
    lease_pb2_grpc,
    prefill_decode_pb2_grpc,
    prefill_pb2_grpc,
    service_info_pb2,
)
from libs.contract.validation import SPEECH_TRANSCRIPTION
from libs.door.in_process import Listener, with_door
from libs.door.server import DoorHttpSettings
from libs.rpc.admission import CAPABILITY as ADMISSION_PRIORITY
from libs.rpc.admission import Admission, admitted
from libs.rpc.drain import drainer
from libs.rpc.main import ServiceParts, client_facing, service_main
from libs.rpc.peers import PeerChannels
from libs.serving.service_info import INSTANCE_ID, SOFTWARE_VERSION
from services.router.cache_lookup import CacheLookup
from services.router.core import Router
from services.router.handshake import PeerChecks
from services.router.membership import MembershipError, encoder_pool, member_pool
from services.router.stubs import Stages, StageStubs
from services.router.warmup import tiny_png


@dataclasses.dataclass(frozen=True)
class RouterSettings(DoorHttpSettings, ClientAuthSettings, CommonSettings):
    """Router: client-facing Generate over encoders and prefill/decode (E/P/D) or PD (E+PD), and
    with --openai-port the OpenAI-compatible HTTP API too (the door's settings: --model, ...)."""

    layout: Literal["e/p/d", "e+pd"] = setting("e/p/d", "deployment layout behind the router")
    encoders: tuple[str, ...] = setting(
        (),
        "encoders: addresses (HOST:PORT, comma-separated), or dns:///NAME:PORT (every A record of NAME, e.g. a "
        "headless Service), or file:///PATH (one address per line); dns and file are re-read while running",
    )
    discovery_refresh_s: float = setting(2.0, "seconds between re-reads of dns:/// and file:/// members")
    prefill: tuple[str, ...] = setting(
        (), "prefill members (e/p/d): addresses, dns:///NAME:PORT or file:///PATH, as --encoders"
    )
    decode: tuple[str, ...] = setting((), "decode members (e/p/d): addresses, dns:///NAME:PORT or file:///PATH")
    pd: tuple[str, ...] = setting((), "prefill-decode members (e+pd): addresses, dns:///NAME:PORT or file:///PATH")
    max_running: int = setting(64, "requests generating at once")
    max_waiting: int = setting(256, "requests waiting for a slot before RESOURCE_EXHAUSTED")
    grace_s: float = setting(10.0, "seconds in-flight requests get on shutdown")
    cache_master: str = setting(
        "", "Mooncake Store master (HOST:PORT) of the encoders' shared cache, checked before dispatch; empty: never"
    )
    cache_lookup_timeout_s: float = setting(0.25, "longest wait for a store lookup before treating it as a miss")
    affinity_slack: int = setting(4, "extra outstanding jobs a new item's hash-preferred encoder may have")
    encode_in_flight: int = setting(
        64,
        "Encode calls sent to one encoder at once; more wait in the router (keep it within the encoders' "
        "--max-running + --max-waiting, 80 by default, so admitted requests are not refused there)",
    )
    decode_in_flight: int = setting(
        -1,
        "e/p/d: requests between the start of their prefill and the end of their decode, per decode member; more "
        "wait before prefill (in their time to first token, not between tokens in a decode queue). -1: what each "
        "decode advertises it runs at once (its --max-running, within its batch: contract 1.7; no bound with "
        "older decodes); 0: no bound",
    )
    decode_queue_s: float = setting(
        10.0,
        "e/p/d: longest a request waits for a decode slot (before its encode and prefill) while every slot is held, "
        "e.g. by long generations; beyond it RESOURCE_EXHAUSTED (OVERLOADED; the OpenAI door's 429 with "
        "Retry-After) naming the slots and the queue's length. 0: only the request's deadline bounds the wait",
    )
    # Off by default: the warm-up's encode counts as a computed item in the encoders' metrics and
    # caches; `epd up`/`epd demo` and the benchmarks turn it on (EPD_WARM_UP=true).
    warm_up: bool = setting(
        False, "at start, send one tiny image request through every encoder and prefill/decode (first contact)"
    )
    max_request_s: float = setting(
        600.0, "longest a request may take, in seconds: the deadline of calls that set none (or a longer one)"
    )
    openai_port: int = setting(
        -1,
        "also serve the OpenAI-compatible HTTP API (the OpenAI door, in this process: no gRPC hop per token) on "
        "HOST:PORT; 0 picks a free one; -1: none",
    )


class GenerateServicer(generate_pb2_grpc.GenerateServiceServicer):
    def __init__(self, router: Router, admission: Admission, max_request_s: float) -> None:
        self._router = router
        self._admission = admission
        self._max_request_s = max_request_s

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: Any
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        # A client that never reads its stream, or sets no deadline, holds resources at most this long.
        cap = time.monotonic() + self._max_request_s
        async with admitted(self._admission, request, context) as deadline:
            async for response in self._router.generate(request, cap if deadline is None else min(deadline, cap)):
                yield response


def stack_info(
    own: service_info_pb2.ServiceInfo, backend: service_info_pb2.ServiceInfo | None
) -> service_info_pb2.ServiceInfo:
    """The router's ServiceInfo with what its stack serves, once its first contact checked the
    model side: the model and, for a speech model, the transcription spec and capability. Clients
    reach only the router; this is how they tell a speech stack from a chat one (`epd transcribe`
    and `epd generate` refuse the wrong one) without a request that would be answered wrongly."""
    if backend is None:
        return own
    out = service_info_pb2.ServiceInfo()
    out.CopyFrom(own)
    out.model.CopyFrom(backend.model)
    if backend.HasField("transcription"):
        out.transcription.CopyFrom(backend.transcription)
    if SPEECH_TRANSCRIPTION in backend.capabilities:
        out.capabilities.append(SPEECH_TRANSCRIPTION)
    return out


async def setup(settings: RouterSettings) -> ServiceParts:
    """Wire the router from settings; channels to every backend are shared through one directory."""
    if not settings.encoders:
        raise SystemExit("router: --encoders is required")
    peers = PeerChannels()  # roles are checked per peer by PeerChecks
    encoder = lambda a: encoder_pb2_grpc.EncoderServiceStub(peers.channel(a))  # noqa: E731
    lease = lambda a: lease_pb2_grpc.LeaseServiceStub(peers.channel(a))  # noqa: E731
    stages = Stages()
    memberships = []
    try:
        if settings.layout == "e/p/d":
            if not (settings.prefill and settings.decode):
                raise SystemExit("router: --prefill and --decode are required for layout e/p/d")
            stages.prefill, prefills = await member_pool(
                settings.prefill, stage="prefill", refresh_s=settings.discovery_refresh_s, peers=peers
            )
            stages.decode, decodes = await member_pool(
                settings.decode, stage="decode", refresh_s=settings.discovery_refresh_s, peers=peers
            )
            memberships += [prefills, decodes]
            checks = PeerChecks(peers, prefill=stages.prefill, decode=stages.decode)
            stubs = StageStubs(
                encoder=encoder,
                lease=lease,
                checks=checks,
                prefill=lambda a: prefill_pb2_grpc.PrefillServiceStub(peers.channel(a)),
                decode=lambda a: decode_pb2_grpc.DecodeServiceStub(peers.channel(a)),
            )
        else:
            if not settings.pd:
                raise SystemExit("router: --pd is required for layout e+pd")
            stages.pd, pds = await member_pool(
                settings.pd, stage="pd", refresh_s=settings.discovery_refresh_s, peers=peers
            )
            memberships.append(pds)
            checks = PeerChecks(peers, prefill=stages.pd, decode=None)
            stubs = StageStubs(
                encoder=encoder,
                lease=lease,
                checks=checks,
                prefill_decode=lambda a: prefill_decode_pb2_grpc.PrefillDecodeServiceStub(peers.channel(a)),
            )
    except MembershipError as exc:
        raise SystemExit(f"router: {exc}") from None
    store = None
    if settings.cache_master:
        # Lookups only: a small staging buffer, and a short deadline (a slow store is a miss).
        config = StoreConfig(
            settings.cache_master,
            local_hostname=settings.host,
            local_buffer_size=1 << 20,
            op_timeout_s=settings.cache_lookup_timeout_s,
        )
        store = MooncakeStoreClient(config)
    cache = CacheLookup(store)
    try:
        pool, membership = await encoder_pool(
            settings.encoders, slack=settings.affinity_slack, refresh_s=settings.discovery_refresh_s, peers=peers
        )
    except MembershipError as exc:
        raise SystemExit(f"router: {exc}") from None
    memberships.append(membership)
    for each in memberships:
        each.start()
    router = Router(
        stubs,
        pool,
        cache=cache,
        stages=stages,
        encode_in_flight=settings.encode_in_flight,
        decode_in_flight=settings.decode_in_flight,
        decode_queue_s=settings.decode_queue_s or None,
    )
    admission = Admission("router", settings.max_running, settings.max_waiting)
    info = service_info_pb2.ServiceInfo(
        contract_version=version.current(),
        role=service_info_pb2.SERVICE_ROLE_ROUTER,
        instance_id=INSTANCE_ID,
        capabilities=[ADMISSION_PRIORITY],
        software_version=SOFTWARE_VERSION,
        max_running_requests=settings.max_running,
    )

    async def close() -> None:
        for each in memberships:
            await each.stop()
        cache.close()
        await peers.close()

    parts = ServiceParts(
        servicers=[
            (
                generate_pb2_grpc.add_GenerateServiceServicer_to_server,
                GenerateServicer(router, admission, settings.max_request_s),
                "epd.v1.GenerateService",
            )
        ],
        info=lambda: stack_info(info, checks.checked_backend),
        close=close,
        drain=drainer(admission),
        # Mooncake's transfer engine picks its own ports: set the client up once ours is bound.
        on_started=cache.connect,
    )
    if settings.warm_up:
        # Before the server listens: launchers send traffic once it does (bounded; failures logged).
        await router.warm_up(list(pool.outstanding), tiny_png())
    parts = client_facing(parts, settings)
    if settings.openai_port < 0:
        return parts
    listener = Listener(
        settings.host,
        settings.openai_port,
        settings.tls_cert,
        settings.tls_key,
        grace_s=settings.grace_s,
        max_request_s=settings.max_request_s,
    )
    return with_door(parts, settings, listener, router, admission)


def main() -> None:
    service_main("router", RouterSettings, setup)
