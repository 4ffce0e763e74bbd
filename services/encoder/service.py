"""gRPC adapter of the encoder: `EncoderService` (+ leases, stats) over `EncoderCore`."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from libs.cache.cache import CacheConfig, EncoderCache
from libs.cache.keys import Namespace
from libs.cache.store import MooncakeStoreClient, StoreConfig
from libs.config import setting
from libs.contract.epd.v1 import encoder_pb2, encoder_pb2_grpc, service_info_pb2
from libs.contract.epd.v1.service_info_pb2 import ModelIdentity
from libs.engine.encoder_runner import EncoderRunner
from libs.engine.types import dtype_name
from libs.rpc.admission import Admission, admitted
from libs.rpc.main import ServiceParts, service_main
from libs.serving.engine_loop import EngineThread
from libs.serving.identity import model_identity, service_info
from libs.serving.parts import model_service_parts
from libs.serving.settings import ModelServiceSettings
from libs.serving.transport import Transport, transfer_config
from services.encoder.core import EncoderCore


@dataclasses.dataclass(frozen=True)
class EncoderSettings(ModelServiceSettings):
    """Encoder: media -> embeddings held in a registered pool for prefill to read."""

    cache_mib: int = setting(256, "in-process encoder-output cache (LRU), in MiB; 0 disables caching")
    cache_master: str = setting("", "Mooncake Store master (HOST:PORT) shared by encoders; empty: local cache only")


class EncoderServicer(encoder_pb2_grpc.EncoderServiceServicer):
    def __init__(self, core: EncoderCore, admission: Admission) -> None:
        self._core = core
        self._admission = admission

    async def Encode(self, request: encoder_pb2.EncodeRequest, context: Any) -> encoder_pb2.EncodeResponse:
        async with admitted(self._admission, request, context):
            return await self._core.encode(request)


async def setup(settings: EncoderSettings) -> ServiceParts:
    torch.set_num_threads(settings.torch_threads)
    runner = EncoderRunner(settings.model)
    identity = model_identity(settings, runner.weights_digest)
    transport = Transport(transfer_config(settings, "encoder"), identity, produce=True, consume=False)
    engine = EngineThread("encoder")
    admission = Admission("encoder", settings.max_running, settings.max_waiting)
    cache, store = _cache(settings, runner, identity)
    core = EncoderCore(runner, transport, engine, file_root=settings.file_root, cache=cache)
    servicer = EncoderServicer(core, admission)
    return model_service_parts(
        (encoder_pb2_grpc.add_EncoderServiceServicer_to_server, servicer, "epd.v1.EncoderService"),
        admission=admission,
        info=service_info(
            service_info_pb2.SERVICE_ROLE_ENCODER, identity, runner.specs.values(), transport.transport_info()
        ),
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
    namespace = Namespace(identity.model_id, identity.revision, identity.weights_digest, dtype_name(runner.dtype))
    store = MooncakeStoreClient(StoreConfig(settings.cache_master)) if settings.cache_master else None
    config = CacheConfig(local_max_bytes=settings.cache_mib << 20)
    return EncoderCache(namespace, store=store, config=config, specs=runner.specs), store


def main() -> None:
    service_main("encoder", EncoderSettings, setup)
