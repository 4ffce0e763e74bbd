"""Prefill + decode on vLLM (the PD role of the E+PD layout).

The service validates and plans each request (`requests.py`), resolves the encoders' NIXL agent
metadata (first-contact check of each encoder, cached per incarnation), and submits it to
`AsyncLLM`; vLLM's worker reads the embeddings itself through the project's EC connector. Tokens
stream back per step (`RequestOutputKind.DELTA`). A request whose embeddings could not be read
fails with the transfer's typed status before any token is streamed; a dead engine fails its
requests with UNAVAILABLE and is restarted (`supervisor.py`).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import structlog

from libs.contract.epd.v1 import chat_pb2, generation_pb2, tensor_pb2
from libs.contract.errors import DeadlineExceeded, EpdError, Unavailable, error_for
from libs.engine import types as eng
from libs.engines.api import Streamed
from libs.engines.settings import EngineSettings
from libs.engines.vllm import runtime
from libs.engines.vllm.requests import RequestPlanner, failure_path
from libs.engines.vllm.supervisor import EngineSupervisor
from libs.serving.identity import model_identity
from libs.serving.transport import MetadataResolver
from libs.telemetry.stages import record_duration, stage, start_phase
from libs.transfer import PeerUnavailable

_log = structlog.get_logger(__name__)
_FINISH = {"length": eng.FinishReason.LENGTH}


class VllmPrefillDecode:
    """`PrefillDecodeEngine` on vLLM's AsyncLLM."""

    name = "vllm"

    def __init__(self, settings: EngineSettings, planner: RequestPlanner, failure_dir: Path) -> None:
        self.planner = planner
        self.weights_digest = planner.checkpoint.weights_digest()
        self._resolver = MetadataResolver(model_identity(settings, self.weights_digest))
        self._metadata: dict[tuple[str, str, str], Any] = {}  # (address, agent, incarnation) -> resolved
        self._failure_dir = failure_dir
        self._default_max_tokens = 256  # as the reference runtime
        self.supervisor = EngineSupervisor(
            lambda: runtime.build_engine(settings, failure_dir=failure_dir, ec_consumer=True)
        )
        self._active = 0

    @classmethod
    async def start(cls, settings: EngineSettings) -> VllmPrefillDecode:
        planner = RequestPlanner(settings.model, max_model_len=settings.max_model_len)
        failure_dir = Path(tempfile.mkdtemp(prefix="epd-vllm-failures-"))
        engine = cls(settings, planner, failure_dir)
        await engine.supervisor.start()
        return engine

    def expected_specs(self) -> list[eng.EmbeddingSpec]:
        return self.planner.expected_specs()

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

    def _agent_metadata(self, ref: tensor_pb2.NixlAgentRef) -> Any:
        key = (ref.producer_address, ref.agent_name, ref.instance_id)
        if key not in self._metadata:
            try:
                self._metadata[key] = self._resolver(ref)  # GetServiceInfo + model check
            except PeerUnavailable as exc:
                raise Unavailable(f"encoder {ref.producer_address}: {exc}") from None
        return self._metadata[key]

    async def generate(
        self,
        request_id: str,
        messages: Sequence[chat_pb2.ChatMessage],
        sampling: eng.SamplingParams,
        deadline: float | None,
    ) -> AsyncIterator[Streamed]:
        planned = await asyncio.to_thread(
            self.planner.plan, request_id, messages, sampling, self._agent_metadata, deadline
        )
        params = runtime.sampling_params(sampling, self._default_max_tokens, planned.items)
        llm = self.supervisor.current()
        failure = failure_path(self._failure_dir, request_id)
        self._active += 1
        generated = 0
        started = time.perf_counter()
        span = None
        try:
            stream = llm.generate(planned.prompt, params, request_id)
            with stage("prefill.compute", "prefill", **{"epd.engine": "vllm"}) as prefill_span:
                first = await _next(stream, deadline)
                prefill_span.set_attribute("epd.prompt_tokens", len(first.prompt_token_ids or ()))
            _raise_load_failure(failure)  # before anything built on missing embeddings is streamed
            span = start_phase("decode.generate", **{"epd.stage": "decode", "epd.engine": "vllm"})
            out: Any = first
            while True:
                chunk, finished = runtime.chunk(out)
                generated += len(chunk.token_ids)
                usage = None
                if finished:
                    prompt_tokens = len(out.prompt_token_ids or ())
                    usage = generation_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=generated)
                yield chunk, usage
                if finished:
                    return
                out = await _next(stream, deadline)
        except EpdError:
            raise
        except Exception as exc:
            raise runtime.engine_error(exc) from exc
        finally:
            self._active -= 1
            failure.unlink(missing_ok=True)
            if span is not None:
                span.set_attribute("epd.decode.tokens", generated)
                span.end()
                record_duration("decode.generate", "decode", time.perf_counter() - started)

    async def close(self) -> None:
        await self.supervisor.close()
        self._resolver.close()
        shutil.rmtree(self._failure_dir, ignore_errors=True)


async def _next(stream: AsyncIterator[Any], deadline: float | None) -> Any:
    """The next output, within the request's deadline; the stream ending early is an engine abort."""
    timeout = None if deadline is None else deadline - time.monotonic()
    if timeout is not None and timeout <= 0:
        raise DeadlineExceeded("deadline passed while generating")
    try:
        return await asyncio.wait_for(anext(stream), timeout)
    except TimeoutError:
        raise DeadlineExceeded("deadline passed while generating") from None
    except StopAsyncIteration:
        raise Unavailable("vLLM ended the request without a finish") from None


def _raise_load_failure(path: Path) -> None:
    """The EC connector's report of embeddings it could not read, as the transfer's typed error."""
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    import grpc

    code = getattr(grpc.StatusCode, str(report.get("code", "UNAVAILABLE")), grpc.StatusCode.UNAVAILABLE)
    raise error_for(code, f"embedding read failed in the vLLM worker: {report.get('message', '')}", "items")
