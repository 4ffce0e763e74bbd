"""gRPC adapter of the encoder: `EncoderService` (+ leases, stats) over `EncoderCore`."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from libs.cache.cache import CacheConfig, EncoderCache
from libs.cache.keys import CACHED_ONLY, Namespace
from libs.cache.store import MooncakeStoreClient, StoreConfig
from libs.config import setting
from libs.contract.epd.v1 import encoder_pb2, encoder_pb2_grpc, service_info_pb2
from libs.contract.epd.v1.service_info_pb2 import ModelIdentity
from libs.rpc.admission import CAPABILITY as ADMISSION_PRIORITY
from libs.rpc.admission import Admission, admitted
from libs.rpc.main import ServiceParts, service_main
from libs.runtime.encoder_runner import EncoderRunner
from libs.runtime.types import dtype_name
from libs.serving.compute_thread import ComputeThread
from libs.serving.identity import model_identity, service_info
from libs.serving.parts import model_service_parts
from libs.serving.settings import ModelServiceSettings
from libs.serving.speech import speech_capabilities
from libs.serving.transport import Transport, transfer_config
from services.encoder.core import EncoderCore


@dataclasses.dataclass(frozen=True)
class EncoderSettings(ModelServiceSettings):
    """Encoder: media -> embeddings held in a registered pool for prefill to read."""

    cache_mib: int = setting(256, "in-process encoder-output cache (LRU), in MiB; 0 disables caching")
    cache_master: str = setting("", "Mooncake Store master (HOST:PORT) shared by encoders; empty: local cache only")
    cached_max_running: int = setting(
        8, "cache-only jobs (the router's short-circuit) running at once, in their own lane apart from compute"
    )


class EncoderServicer(encoder_pb2_grpc.EncoderServiceServicer):
    def __init__(self, core: EncoderCore, compute: Admission, cached: Admission) -> None:
        self._core = core
        self._compute = compute
        self._cached = cached  # cache-only jobs never wait behind the tower

    async def Encode(self, request: encoder_pb2.EncodeRequest, context: Any) -> encoder_pb2.EncodeResponse:
        cached_only = request.cache_policy == encoder_pb2.CACHE_POLICY_CACHED_ONLY
        async with admitted(self._cached if cached_only else self._compute, request, context):
            return await self._core.encode(request)


async def setup(settings: EncoderSettings) -> ServiceParts:
    torch.set_num_threads(settings.torch_threads)
    runner = EncoderRunner(settings.model)
    identity = model_identity(settings, runner.weights_digest)
    transport = Transport(transfer_config(settings, "encoder"), identity, produce=True, consume=False)
    engine = ComputeThread("encoder")
    admission = Admission("encoder", settings.max_running, settings.max_waiting)
    cached_lane = Admission("encoder.cached", settings.cached_max_running, settings.max_waiting)
    cache, store = _cache(settings, runner, identity)
    core = EncoderCore(runner, transport, engine, file_root=settings.file_root, cache=cache)
    servicer = EncoderServicer(core, admission, cached_lane)
    info = service_info(
        service_info_pb2.SERVICE_ROLE_ENCODER,
        identity,
        runner.specs.values(),
        transport.transport_info(),
        capabilities=(
            ADMISSION_PRIORITY,
            *((CACHED_ONLY,) if cache is not None else ()),
            *speech_capabilities(runner.adapter),
        ),
    )
    if cache is not None:
        info.encoder_cache.CopyFrom(
            service_info_pb2.EncoderCacheInfo(
                key_prefix=cache.namespace.key_prefix,
                shared_store=store is not None,
                local_capacity_bytes=cache.config.local_max_bytes,
            )
        )
    return model_service_parts(
        (encoder_pb2_grpc.add_EncoderServiceServicer_to_server, servicer, "epd.v1.EncoderService"),
        admission=admission,
        other_lanes=(cached_lane,),
        info=info,
        engine=engine,
        transport=transport,
        on_close=cache.close if cache is not None else lambda: None,
        # Set the store client up before taking requests (inside the first lookup, the set-up would
        # exceed the lookup's deadline: a miss), and only once our gRPC port is bound: Mooncake's
        # transfer engine picks its own listening ports and must not take the one we announce.
        on_listening=(lambda _: store.connect()) if store is not None else None,
    )


def _cache(
    settings: EncoderSettings, runner: EncoderRunner, identity: ModelIdentity
) -> tuple[EncoderCache | None, MooncakeStoreClient | None]:
    """The encoder-output cache: local LRU, in front of Mooncake Store when a master is configured."""
    if settings.cache_mib <= 0:
        return None, None
    namespace = Namespace(
        identity.model_id,
        identity.revision,
        identity.weights_digest,
        dtype_name(runner.dtype),
        preprocessing=runner.preprocessing_digest,
    )
    # The store reaches this client's staging memory at our own address (a pod's, in Kubernetes).
    store = (
        MooncakeStoreClient(StoreConfig(settings.cache_master, local_hostname=settings.host))
        if settings.cache_master
        else None
    )
    config = CacheConfig(local_max_bytes=settings.cache_mib << 20)
    return EncoderCache(namespace, store=store, config=config, specs=runner.specs), store


def main() -> None:
    service_main("encoder", EncoderSettings, setup)
