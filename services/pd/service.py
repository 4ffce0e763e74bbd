"""gRPC adapter of the PD service: `PrefillDecodeService` (+ stats) over `PrefillDecodeCore`, on the
engine chosen with `--engine` (reference runtime or vLLM)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import torch

from libs.backends.api import PrefillDecodeEngine, engine_capabilities
from libs.backends.settings import EngineSettings
from libs.contract.epd.v1 import prefill_decode_pb2, prefill_decode_pb2_grpc, service_info_pb2
from libs.rpc.admission import CAPABILITY as ADMISSION_PRIORITY
from libs.rpc.admission import Admission, admitted
from libs.rpc.main import ServiceParts, service_main
from libs.serving.identity import model_identity, service_info
from libs.serving.parts import model_service_parts
from libs.serving.settings import ChunkedPrefillSettings
from libs.serving.transport import Transport, transfer_config
from services.pd.core import PrefillDecodeCore


@dataclasses.dataclass(frozen=True)
class PrefillDecodeSettings(ChunkedPrefillSettings, EngineSettings):
    """PD: metadata-only requests -> prefill and decode in one process (E+PD layout)."""


class PrefillDecodeServicer(prefill_decode_pb2_grpc.PrefillDecodeServiceServicer):
    def __init__(self, core: PrefillDecodeCore, admission: Admission) -> None:
        self._core = core
        self._admission = admission

    async def PrefillDecode(
        self, request: prefill_decode_pb2.PrefillDecodeRequest, context: Any
    ) -> AsyncIterator[prefill_decode_pb2.PrefillDecodeResponse]:
        async with admitted(self._admission, request, context) as deadline:
            async for response in self._core.generate(request, deadline):
                yield response


async def _engine(settings: PrefillDecodeSettings) -> tuple[PrefillDecodeEngine, Transport | None]:
    if settings.engine == "vllm":
        from libs.backends.vllm.pd import VllmPrefillDecode  # imports vLLM (~15 s): only when chosen

        return await VllmPrefillDecode.start(settings), None
    from libs.backends.reference.pd import ReferencePrefillDecode
    from libs.runtime.lm_runtime import LanguageModelRuntime

    torch.set_num_threads(settings.torch_threads)
    runtime = LanguageModelRuntime(settings.model)
    # The reference engine reads the embeddings with this process's transport.
    identity = model_identity(settings, runtime.weights_digest)
    transport = Transport(transfer_config(settings, "pd"), identity, produce=False, consume=True)
    return ReferencePrefillDecode(
        runtime, transport, max_batch=settings.max_batch, chunk_tokens=settings.prefill_chunk_tokens
    ), transport


def _admitted_at_once(settings: PrefillDecodeSettings) -> int:
    """The reference engine runs at most its batch: the rest wait in admission. vLLM queues beyond
    its batch itself, by priority (`scheduling_policy="priority"`), and starts a waiting request
    in the very step a sequence ends: it gets `max_running`, as the vLLM prefill does."""
    if settings.engine == "vllm":
        return settings.max_running
    return min(settings.max_running, settings.max_batch)


async def setup(settings: PrefillDecodeSettings) -> ServiceParts:
    engine, transport = await _engine(settings)
    identity = model_identity(settings, engine.weights_digest)
    admission = Admission("pd", _admitted_at_once(settings), settings.max_waiting)
    servicer = PrefillDecodeServicer(PrefillDecodeCore(engine), admission)
    return model_service_parts(
        (prefill_decode_pb2_grpc.add_PrefillDecodeServiceServicer_to_server, servicer, "epd.v1.PrefillDecodeService"),
        admission=admission,
        info=service_info(
            service_info_pb2.SERVICE_ROLE_PREFILL_DECODE,
            identity,
            engine.expected_specs(),
            transport.transport_info() if transport is not None else (),
            capabilities=engine_capabilities(settings.engine, (ADMISSION_PRIORITY,)),
        ),
        engine=None,
        transport=transport,
        active_sequences=lambda: engine.active,
        on_close_async=engine.close,
        health=getattr(engine, "watch_health", None),
    )


def main() -> None:
    service_main("pd", PrefillDecodeSettings, setup)
