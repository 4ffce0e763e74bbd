"""Prefill on vLLM (the P role of the E/P/D layout).

A request is planned and its embeddings read into the service's shared pool as for PD (`pd.py`);
vLLM computes the prompt's KV and samples the first token (`max_tokens` 1, `do_remote_decode`:
its NixlConnector keeps the blocks for decode). The response carries the handoff as typed fields
(`KvCache.paged`: engine id, request id, side channel, block ids; `DecodeState.engine_prompt`: the
prompt as the engine took it), and the blocks are a lease of this service: read by decode's
engine, released through `LeaseService` (`KvLeases`), or freed by vLLM at expiry. A request that
ends at its first token (EOS, a stop sequence, `max_tokens` 1) hands nothing over and frees its
blocks at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from libs.backends.api import PrefillBackend
from libs.backends.engines import PAGED_KV, capability
from libs.backends.in_flight import InFlight
from libs.backends.settings import EngineSettings
from libs.backends.vllm import runtime
from libs.backends.vllm.requests import RequestPlanner, failure_path
from libs.backends.vllm.streams import embedding_reads, raise_load_failure, read_items
from libs.backends.vllm.supervisor import EngineLife, EngineSupervisor, start_or_exit
from libs.contract.epd.v1 import generation_pb2, prefill_pb2, stats_pb2
from libs.contract.errors import EpdError, Unavailable
from libs.model import types as eng
from libs.serving import convert
from libs.telemetry.stages import record_prompt, stage

DEFAULT_MAX_TOKENS = 256  # as the reference runtime


class KvLeases:
    """The KV handoffs this service's engine holds for decode, as leases (stats, drain, release).

    The worker's connector knows which blocks are still held (`epd_kv_status`); this book keeps
    the lease ids handed out and asks the worker while any is outstanding."""

    def __init__(self, supervisor: EngineSupervisor, poll_s: float = 0.25) -> None:
        self._supervisor = supervisor
        self._poll_s = poll_s
        self._handed: dict[str, float] = {}  # lease id (engine request id) -> monotonic hand-out time
        self._counts = {"acked": 0, "released": 0, "expired": 0}
        self._task: asyncio.Task[None] | None = None

    def hand_out(self, lease_id: str) -> None:
        self._handed[lease_id] = time.monotonic()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._watch(), name="vllm-kv-leases")

    def held(self) -> int:
        return len(self._handed)

    async def release(self, lease_ids: Sequence[str]) -> int:
        ours = [lease_id for lease_id in lease_ids if lease_id in self._handed]
        if ours and self._supervisor.alive:
            await self._supervisor.current().collective_rpc("epd_release_kv", args=(ours,))
        for lease_id in ours:
            self._handed.pop(lease_id, None)
        return len(ours)

    async def pool_stats(self) -> stats_pb2.TransferPoolStats:
        await self._refresh()
        return stats_pb2.TransferPoolStats(
            active_leases=len(self._handed),
            acked_leases=self._counts["acked"],
            released_leases=self._counts["released"],
            expired_leases=self._counts["expired"],
        )

    async def _refresh(self) -> None:
        if not self._supervisor.alive:
            self._handed.clear()  # a dead engine's blocks died with it
            return
        status = (await self._supervisor.current().collective_rpc("epd_kv_status"))[0]
        self._counts = {key: int(status[key]) for key in self._counts}
        held = set(status["held_ids"])
        # A handoff the worker has not heard of yet (it learns at its next step) stays in the book.
        settle = time.monotonic() - 2.0
        self._handed = {lid: at for lid, at in self._handed.items() if lid in held or at > settle}

    async def _watch(self) -> None:
        while self._handed:
            await asyncio.sleep(self._poll_s)
            try:
                await self._refresh()
            except Exception:  # the engine is restarting: the supervisor reports it
                await asyncio.sleep(1.0)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()


class VllmPrefill(PrefillBackend):
    """`PrefillBackend` on vLLM's AsyncLLM: the KV stays in its blocks for decode."""

    name = "vllm"

    def __init__(self, settings: EngineSettings, planner: RequestPlanner, failure_dir: Path) -> None:
        self._settings = settings
        self.planner = planner
        self.weights_digest = planner.checkpoint.weights_digest()
        # The embeddings' reads (not `transport`: the leases this service serves are vLLM's KV blocks).
        self.reads = embedding_reads(settings, "prefill", self.weights_digest)
        self._failure_dir = failure_dir
        self.supervisor = EngineSupervisor(self._build, EngineLife.of(settings), queued=lambda: self._active)
        self.leases: KvLeases = KvLeases(self.supervisor)  # the KV blocks vLLM keeps for decode
        self.address = ""  # this service's, once it listens (the handoff names it)
        self.max_running = settings.max_running
        self.in_flight = InFlight()
        self._active = 0

    def _build(self) -> Any:
        kv = runtime.KvTransfer(
            "kv_producer", f"epd-prefill-{secrets.token_hex(6)}", runtime.side_channel_port(self._settings)
        )
        return runtime.build_engine(self._settings, failure_dir=self._failure_dir, ec_consumer=True, kv=kv)

    def embedding_specs(self) -> list[eng.EmbeddingSpec]:
        return self.planner.expected_specs()

    def capabilities(self) -> tuple[str, ...]:
        return (PAGED_KV, capability(self.name), *runtime.held_items(self.planner.adapter))

    def serving_at(self, address: str) -> None:
        self.address = address

    @property
    def active(self) -> int:
        return self._active

    def watch_health(self, setter: Any) -> None:
        self.supervisor.watch_health(setter)

    def watch_fatal(self, fail: Any) -> None:
        self.supervisor.watch_fatal(fail)

    async def prefill(self, request: prefill_pb2.PrefillRequest, deadline: float | None) -> prefill_pb2.PrefillResponse:
        with self.in_flight.track(request.request_id):
            return await self._prefill(request, deadline)

    async def _prefill(
        self, request: prefill_pb2.PrefillRequest, deadline: float | None
    ) -> prefill_pb2.PrefillResponse:
        sampling = convert.sampling_to_engine(request.sampling)
        planned = await asyncio.to_thread(
            self.planner.plan, request.request_id, request.messages, sampling, request.cache_salt
        )
        self.supervisor.engine()  # UNAVAILABLE before any read while the engine is down
        failure = failure_path(self._failure_dir, request.request_id)
        self._active += 1
        out: Any = None
        handed = False
        items = None
        try:
            items, slots = await read_items(
                self.reads, self.planner, request.request_id, request.messages, planned.uuids, deadline
            )
            params = runtime.sampling_params(
                sampling,
                DEFAULT_MAX_TOKENS,
                slots,
                seed=runtime.split_seed(sampling, request.request_id),
                max_tokens=1,
                kv_transfer_params={"do_remote_decode": True},
                request_id=request.request_id,
            )
            engine = self.supervisor.engine()
            stream = engine.llm.generate(
                runtime.salted(planned.prompt, request.cache_salt),
                params,
                request.request_id,
                priority=runtime.engine_priority(request.priority),
            )
            with stage("prefill.compute", "prefill", **{"epd.engine": "vllm"}) as span:
                out = await engine.next(stream, deadline)
                while not out.finished:
                    out = await engine.next(stream, deadline)
                cached = out.num_cached_tokens or 0
                record_prompt(
                    span, prompt_tokens=len(out.prompt_token_ids or ()), cached_tokens=cached, reused_items={}
                )
            raise_load_failure(failure)  # embeddings that did not reach vLLM: nothing built on them leaves
            response = self._response(request, planned.prompt["prompt_token_ids"], sampling, out)
            handed = response.HasField("kv_cache")
            if handed:
                self.leases.hand_out(response.kv_cache.paged.lease_id)
            return response
        except EpdError:
            raise
        except Exception as exc:
            raise runtime.engine_error(exc) from exc
        finally:
            self._active -= 1
            failure.unlink(missing_ok=True)
            if items is not None:
                items.release()  # vLLM is done with the prompt: its KV holds what they gave
            params_out = getattr(out, "kv_transfer_params", None) or {}
            if not handed and params_out.get("remote_request_id"):
                # Ended at the first token, failed or cancelled: nobody will read these blocks.
                await self._release_now(str(params_out["remote_request_id"]))

    async def _release_now(self, engine_request_id: str) -> None:
        if self.supervisor.alive:
            with contextlib.suppress(Exception):  # vLLM frees them at its lease expiry anyway
                await self.supervisor.current().collective_rpc("epd_release_kv", args=([engine_request_id],))

    def _response(
        self, request: prefill_pb2.PrefillRequest, prompt_ids: list[int], sampling: eng.SamplingParams, out: Any
    ) -> prefill_pb2.PrefillResponse:
        chunk, _ = runtime.chunk(out, sampling.logprobs)
        ended = out.outputs[0].finish_reason == "stop"  # EOS, a stop token id or a stop sequence
        prompt_tokens = len(out.prompt_token_ids or ())
        state = prefill_pb2.DecodeState(
            next_input_token_id=chunk.token_ids[-1] if chunk.token_ids else 0,
            generated_tokens=len(chunk.token_ids),
            generated_text=chunk.text,
            prompt_tokens=prompt_tokens,
            cached_prompt_tokens=out.num_cached_tokens or 0,
            cache_salt=request.cache_salt,  # the decode's own prefix cache keeps the tenant's scope
        )
        response = prefill_pb2.PrefillResponse(first_chunk=chunk, decode_state=state)
        wanted = sampling.max_tokens or DEFAULT_MAX_TOKENS
        if ended or wanted <= len(chunk.token_ids):
            return response  # generation ended at the first token: no KV for decode
        response.first_chunk.finish_reason = generation_pb2.FINISH_REASON_UNSPECIFIED  # our cap, not the client's
        params = out.kv_transfer_params
        if not params or not params.get("remote_block_ids"):
            raise Unavailable("vLLM kept no KV blocks for decode")
        layers, heads, head_dim = self.planner.kv_dims()
        expire = time.time() + max(1.0, self._settings.lease_ttl_s - 1.0)  # vLLM's clock started first
        paged = prefill_pb2.PagedKvBlocks(
            producer_address=self.address,
            lease_id=str(params["remote_request_id"]),
            engine_id=str(params["remote_engine_id"]),
            engine_request_id=str(params["remote_request_id"]),
            side_channel_host=str(params["remote_host"]),
            side_channel_port=int(params["remote_port"]),
            groups=[prefill_pb2.KvBlockIds(block_ids=list(group)) for group in params["remote_block_ids"]],
            tensor_parallel_size=int(params.get("tp_size") or 1),
            pipeline_parallel_size=int(params.get("pp_size") or 1),
            decode_context_parallel_size=int(params.get("dcp_size") or 1),
            transfer_mode=prefill_pb2.KV_TRANSFER_MODE_PULL,
        )
        paged.lease_expire_time.FromNanoseconds(int(expire * 1e9))
        response.kv_cache.CopyFrom(
            prefill_pb2.KvCache(
                layout=prefill_pb2.KvCacheLayout(
                    num_layers=layers,
                    num_kv_heads=heads,
                    head_dim=head_dim,
                    num_tokens=int(params.get("remote_num_tokens") or prompt_tokens),
                    dtype=convert.DTYPE_TO_WIRE[runtime.engine_dtype(self.supervisor.current())],
                ),
                paged=paged,
            )
        )
        response.decode_state.engine_prompt.token_ids.extend(prompt_ids)
        response.decode_state.engine_prompt.items.extend(
            part.encoded.layout for message in request.messages for part in message.parts if part.HasField("encoded")
        )
        return response

    async def close(self) -> None:
        await self.leases.close()
        await self.supervisor.close()
        self.reads.close()
        shutil.rmtree(self._failure_dir, ignore_errors=True)


async def start(settings: EngineSettings) -> VllmPrefill:
    """Start vLLM's engine: a KV producer, consumer of the encoders' embeddings."""
    runtime.refuse_unsupported(settings.model, "e/p/d")
    planner = RequestPlanner(settings.model, max_model_len=settings.max_model_len)
    backend = VllmPrefill(settings, planner, Path(tempfile.mkdtemp(prefix="epd-vllm-failures-")))
    await asyncio.to_thread(runtime.import_vllm, settings)  # before the start's clock runs: the import is slow
    await start_or_exit(backend.supervisor, backend.close)
    return backend
