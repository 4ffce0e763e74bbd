"""Prefill + decode on vLLM (the PD role of the E+PD layout).

The service validates and plans each request (`requests.py`), reads its embeddings over NIXL into
its shared pool (first contact with each encoder checked; the request's deadline; while it reads,
vLLM steps every other sequence on), waits for the next round if others run (`--prefill-batch-steps`,
`libs/backends/prefill_batching.py`), then submits it to `AsyncLLM`, whose worker copies them into
its encoder cache through the project's EC connector. Tokens stream back per step
(`RequestOutputKind.DELTA`). A request whose embeddings could not be read fails with the
transfer's typed status before vLLM sees it; a dead engine fails its requests with UNAVAILABLE
and is restarted (`supervisor.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import time
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any

import structlog

from libs.backends.api import PrefillDecodeBackend
from libs.backends.engines import capability
from libs.backends.in_flight import InFlight
from libs.backends.prefill_batching import PrefillBatching
from libs.backends.settings import PrefillDecodeEngineSettings
from libs.backends.vllm import runtime
from libs.backends.vllm.plugin import WHISPER_TIMESTAMPS_ARG
from libs.backends.vllm.requests import RequestPlanner, failure_path, with_encoder_states
from libs.backends.vllm.streams import embedding_reads, raise_load_failure, read_items
from libs.backends.vllm.supervisor import EngineLife, EngineSupervisor, start_or_exit
from libs.contract.epd.v1 import generation_pb2, prefill_decode_pb2, service_info_pb2
from libs.contract.errors import EpdError
from libs.model import types as eng
from libs.serving import convert
from libs.serving.speech import speech_capabilities, transcription_spec
from libs.telemetry.stages import record_duration, record_prompt, record_stage, stage, start_phase

_log = structlog.get_logger(__name__)
_FINISH = {"length": eng.FinishReason.LENGTH}


class VllmPrefillDecode(PrefillDecodeBackend):
    """`PrefillDecodeBackend` on vLLM's AsyncLLM."""

    name = "vllm"

    def __init__(self, settings: PrefillDecodeEngineSettings, planner: RequestPlanner, failure_dir: Path) -> None:
        self.planner = planner
        self.weights_digest = planner.checkpoint.weights_digest()
        # The embeddings' reads, also this service's transport as the reference PD's (stats, pool).
        self.reads = embedding_reads(settings, "pd", self.weights_digest)
        self.transport = self.reads
        self._failure_dir = failure_dir
        self._default_max_tokens = 256  # as the reference runtime
        # Whisper's encoder states go into the request (whisper_model.py), not through the EC connector.
        speech = planner.adapter.is_encoder_decoder
        self.supervisor = EngineSupervisor(
            lambda: runtime.build_engine(settings, failure_dir=failure_dir, ec_consumer=not speech),
            EngineLife.of(settings),
            queued=lambda: self._active,
        )
        # vLLM queues beyond its batch itself, by priority (`scheduling_policy="priority"`), and
        # starts a waiting request in the very step a sequence ends: it runs `max_running`.
        self.max_running = settings.max_running
        self.in_flight = InFlight()
        self._active = 0
        self.batching = PrefillBatching(settings.prefill_batch_steps, settings.max_batch)

    def embedding_specs(self) -> list[eng.EmbeddingSpec]:
        return self.planner.expected_specs()

    def capabilities(self) -> tuple[str, ...]:
        return (
            capability(self.name),
            *runtime.held_items(self.planner.adapter),
            *speech_capabilities(self.planner.adapter),
        )

    def extend_info(self, info: service_info_pb2.ServiceInfo) -> None:
        if (spec := transcription_spec(self.planner.adapter)) is not None:
            info.transcription.CopyFrom(spec)

    @property
    def active(self) -> int:
        """Requests in this service's streams, or still held by vLLM (its own count: a cancelled
        request is done only once vLLM aborted it and freed its blocks)."""
        held = 0
        if self.supervisor.alive:
            held = int(self.supervisor.current().get_num_unfinished_requests())
        return max(self._active, held)

    def watch_health(self, setter: Any) -> None:
        self.supervisor.watch_health(setter)

    def watch_fatal(self, fail: Any) -> None:
        self.supervisor.watch_fatal(fail)

    async def generate(
        self, request: prefill_decode_pb2.PrefillDecodeRequest, deadline: float | None
    ) -> AsyncIterator[prefill_decode_pb2.PrefillDecodeResponse]:
        with self.in_flight.track(request.request_id):
            async with contextlib.aclosing(self._generate(request, deadline)) as stream:
                async for chunk, usage in stream:
                    response = prefill_decode_pb2.PrefillDecodeResponse(chunk=chunk)
                    if usage is not None:
                        response.usage.CopyFrom(usage)
                    yield response

    async def _generate(
        self, request: prefill_decode_pb2.PrefillDecodeRequest, deadline: float | None
    ) -> AsyncGenerator[tuple[generation_pb2.TokenChunk, generation_pb2.Usage | None], None]:
        request_id, priority = request.request_id, request.priority
        sampling = convert.sampling_to_engine(request.sampling)
        planned = await asyncio.to_thread(self.planner.plan, request_id, request.messages, sampling, request.cache_salt)
        self.supervisor.engine()  # UNAVAILABLE before any read while the engine is down
        failure = failure_path(self._failure_dir, request_id)
        self._active += 1
        generated = 0
        started = time.perf_counter()
        span = None
        items = None
        ticket = None
        try:
            items, slots = await read_items(
                self.reads, self.planner, request_id, request.messages, planned.uuids, deadline
            )
            prompt = runtime.salted(planned.prompt, request.cache_salt)
            if planned.speech:
                # vLLM keeps its own copy of the states (they travel to EngineCore): the slot goes back now.
                prompt = with_encoder_states(planned, items.items[0].tensors["embeddings"].clone())
                items.release()
                items, slots = None, {}
            default_max_tokens = planned.max_tokens or self._default_max_tokens
            extra = {WHISPER_TIMESTAMPS_ARG: sampling.timestamps} if planned.speech else None
            params = runtime.sampling_params(
                sampling, default_max_tokens, slots, extra_args=extra, request_id="" if planned.speech else request_id
            )
            held_from = time.time_ns()
            ticket = await self.batching.enter(deadline)
            if ticket.held:
                record_stage("pd.prefill_batch", "queue", held_from, time.time_ns())
            engine = self.supervisor.engine()
            llm = engine.llm
            stream = llm.generate(prompt, params, request_id, priority=runtime.engine_priority(priority))
            with stage("prefill.compute", "prefill", **{"epd.engine": "vllm"}) as prefill_span:
                first = await engine.next(stream, deadline)
                ticket.stepped()
                prompt_tokens = len(first.prompt_token_ids or ())
                cached = first.num_cached_tokens or 0
                record_prompt(prefill_span, prompt_tokens=prompt_tokens, cached_tokens=cached, reused_items={})
            raise_load_failure(failure)  # before anything built on missing embeddings is streamed
            span = start_phase("decode.generate", **{"epd.stage": "decode", "epd.engine": "vllm"})
            out: Any = first
            while True:
                chunk, finished = runtime.chunk(out, sampling.logprobs)
                generated += len(chunk.token_ids)
                usage = None
                if finished:
                    usage = generation_pb2.Usage(
                        prompt_tokens=len(out.prompt_token_ids or ()),
                        completion_tokens=generated,
                        cached_prompt_tokens=out.num_cached_tokens or 0,
                    )
                yield chunk, usage
                if finished:
                    return
                out = await engine.next(stream, deadline)
                ticket.stepped()
        except EpdError:
            raise
        except Exception as exc:
            raise runtime.engine_error(exc) from exc
        finally:
            self._active -= 1
            if ticket is not None:
                ticket.leave()
            failure.unlink(missing_ok=True)
            if items is not None:
                # vLLM is done with the request (finished, failed or aborted by the stream's close):
                # a preempted sequence re-reads its items from these slots until then.
                items.release()
            if span is not None:
                span.set_attribute("epd.decode.tokens", generated)
                span.end()
                record_duration("decode.generate", "decode", time.perf_counter() - started)

    async def close(self) -> None:
        await self.supervisor.close()
        self.reads.close()
        shutil.rmtree(self._failure_dir, ignore_errors=True)


async def start(settings: PrefillDecodeEngineSettings) -> VllmPrefillDecode:
    """Start vLLM's engine: a consumer of the encoders' embeddings."""
    runtime.refuse_unsupported(settings.model, "e+pd")
    planner = RequestPlanner(settings.model, max_model_len=settings.max_model_len)
    failure_dir = Path(tempfile.mkdtemp(prefix="epd-vllm-failures-"))
    backend = VllmPrefillDecode(settings, planner, failure_dir)
    await asyncio.to_thread(runtime.import_vllm, settings)  # before the start's clock runs: the import is slow
    await start_or_exit(backend.supervisor, backend.close)
    return backend
