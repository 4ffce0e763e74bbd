"""gRPC adapter of decode: `DecodeService` (+ stats) over `DecodeCore`."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import torch

from libs.backends.api import engine_capabilities
from libs.backends.identity import PAGED_KV
from libs.backends.settings import EngineSettings
from libs.config import setting
from libs.contract.epd.v1 import decode_pb2, decode_pb2_grpc, service_info_pb2
from libs.rpc.admission import CAPABILITY as ADMISSION_PRIORITY
from libs.rpc.admission import Admission, admitted
from libs.rpc.main import ServiceParts, service_main
from libs.serving.compute_thread import ComputeThread, DecodeLoop
from libs.serving.identity import model_identity, service_info
from libs.serving.parts import model_service_parts
from libs.serving.transport import Transport, transfer_config
from services.decode.core import DecodeCore
from services.decode.engine_core import EngineDecodeCore


@dataclasses.dataclass(frozen=True)
class DecodeSettings(EngineSettings):
    """Decode: KV caches from prefill -> streamed tokens, many sequences per batched step."""

    pool_mib: int = setting(512, "registered tensor pool for KV reads, in MiB")


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self, core: DecodeCore | EngineDecodeCore, admission: Admission) -> None:
        self._core = core
        self._admission = admission

    async def Decode(self, request: decode_pb2.DecodeRequest, context: Any) -> AsyncIterator[decode_pb2.DecodeResponse]:
        async with admitted(self._admission, request, context) as deadline:
            async for response in self._core.decode(request, deadline):
                yield response


async def _vllm_setup(settings: DecodeSettings) -> ServiceParts:
    from libs.backends.vllm.decode import VllmDecode  # imports vLLM (~15 s): only when chosen

    engine = await VllmDecode.start(settings)
    # Requests beyond vLLM's batch (max_num_seqs = max_batch) wait in admission, not in vLLM: a
    # handoff's lease is checked before vLLM sees it, and vLLM reads the blocks as soon as it
    # takes the request; queued inside vLLM, a lease could expire (blocks reused) before the read.
    admission = Admission("decode", min(settings.max_running, settings.max_batch), settings.max_waiting)
    servicer = DecodeServicer(EngineDecodeCore(engine), admission)
    return model_service_parts(
        (decode_pb2_grpc.add_DecodeServiceServicer_to_server, servicer, "epd.v1.DecodeService"),
        admission=admission,
        info=service_info(
            service_info_pb2.SERVICE_ROLE_DECODE,
            model_identity(settings, engine.weights_digest),
            capabilities=engine_capabilities("vllm", (ADMISSION_PRIORITY, PAGED_KV)),
        ),
        engine=None,
        active_sequences=lambda: engine.active,
        on_close_async=engine.close,
        health=engine.watch_health,
    )


async def setup(settings: DecodeSettings) -> ServiceParts:
    if settings.engine == "vllm":
        return await _vllm_setup(settings)
    from libs.runtime.decode_runner import DecodeRunner
    from libs.runtime.lm_runtime import LanguageModelRuntime
    from libs.serving.speech import speech_capabilities

    torch.set_num_threads(settings.torch_threads)
    runtime = LanguageModelRuntime(settings.model)
    identity = model_identity(settings, runtime.weights_digest)
    transport = Transport(transfer_config(settings, "decode"), identity, produce=False, consume=True)
    engine = ComputeThread("decode")
    loop = DecodeLoop(DecodeRunner(runtime, max_batch=settings.max_batch), engine)
    # Requests beyond the decode batch wait in admission instead of failing in the runner.
    admission = Admission("decode", min(settings.max_running, settings.max_batch), settings.max_waiting)
    servicer = DecodeServicer(DecodeCore(runtime, loop, transport), admission)
    return model_service_parts(
        (decode_pb2_grpc.add_DecodeServiceServicer_to_server, servicer, "epd.v1.DecodeService"),
        admission=admission,
        info=service_info(
            service_info_pb2.SERVICE_ROLE_DECODE,
            identity,
            (),
            transport.transport_info(),
            capabilities=(ADMISSION_PRIORITY, *speech_capabilities(runtime.adapter)),
        ),
        engine=engine,
        transport=transport,
        active_sequences=lambda: loop.active,
    )


def main() -> None:
    service_main("decode", DecodeSettings, setup)
