"""Decode on vLLM (the D role of the E/P/D layout).

The request names prefill's paged KV (`KvCache.paged`) and the prompt as prefill's engine took it
(`DecodeState.engine_prompt`: token ids + item layouts, no embeddings). vLLM's NixlConnector (the
project's subclass, `kv_connector.py`) fetches the producer engine's agent metadata from its side
channel, READs the blocks into blocks of its own and notifies the producer, which frees them.

vLLM's decode recomputes the prompt's last token and samples the first token again (both
engines sample it from the same seed: `runtime.split_seed`); it must equal the token prefill
streamed, and is not streamed twice. Tokens stream per step. Checked before vLLM sees the
request: the lease has not expired, the producer serves our model on vLLM (first contact), the
prompt's placeholders match its items. A handoff vLLM cannot read (the producer restarted, its
blocks freed) ends in NOT_FOUND; an engine death in UNAVAILABLE (the supervisor restarts it).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import tempfile
import time
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from libs.backends.api import DecodeBackend
from libs.backends.engines import PAGED_KV, capability, engine_of
from libs.backends.in_flight import InFlight
from libs.backends.settings import EngineSettings
from libs.backends.vllm import runtime
from libs.backends.vllm.prefill import DEFAULT_MAX_TOKENS
from libs.backends.vllm.requests import RequestPlanner
from libs.backends.vllm.supervisor import EngineLife, EngineSupervisor, start_or_exit
from libs.contract import version
from libs.contract.epd.v1 import decode_pb2, generation_pb2, prefill_pb2, service_info_pb2, service_info_pb2_grpc
from libs.contract.errors import DataLoss, EpdError, FailedPrecondition, InvalidArgument, NotFound, Unavailable
from libs.contract.reasons import Reason
from libs.rpc.peers import check_peer
from libs.rpc.server import open_channel
from libs.serving import convert
from libs.serving.service_info import model_identity
from libs.telemetry.stages import record_duration, record_transfer, stage, start_phase

# A lease this close to its expiry is treated as gone: vLLM would read freed blocks (seconds).
_EXPIRY_MARGIN_S = 0.5


class Producers:
    """First contact with each prefill service a handoff names: it must be a prefill running vLLM
    with our model (checked once per address and instance)."""

    def __init__(self, model: service_info_pb2.ModelIdentity) -> None:
        self._model = model
        self._checked: dict[str, str] = {}  # address -> instance id

    async def check(self, address: str) -> None:
        if address in self._checked:
            return
        try:
            async with open_channel(address) as channel:
                reply = await service_info_pb2_grpc.ServiceInfoServiceStub(channel).GetServiceInfo(
                    service_info_pb2.GetServiceInfoRequest(caller_contract_version=version.current()), timeout=5
                )
        except grpc.aio.AioRpcError as exc:
            raise Unavailable(f"prefill {address} unreachable: {exc.code().name}", reason=Reason.KV_GONE) from None
        info = reply.info
        check_peer(info, address, roles=[service_info_pb2.SERVICE_ROLE_PREFILL], model=self._model)
        if engine_of(info) != "vllm":
            raise FailedPrecondition(
                f"prefill {address} runs the {engine_of(info)} engine and this decode the vllm engine: "
                "a KV cache moves only between services of the same engine"
            )
        self._checked[address] = info.instance_id


def kv_transfer_params(kv: prefill_pb2.KvCache) -> dict[str, Any]:
    """The typed handoff as vLLM's NixlConnector reads it on the decode side."""
    paged = kv.paged
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": paged.engine_id,
        "remote_request_id": paged.engine_request_id,
        "remote_host": paged.side_channel_host,
        "remote_port": paged.side_channel_port,
        "remote_block_ids": [list(group.block_ids) for group in paged.groups],
        "remote_num_tokens": kv.layout.num_tokens,
        "tp_size": paged.tensor_parallel_size,
        "pp_size": paged.pipeline_parallel_size,
        "dcp_size": paged.decode_context_parallel_size,
    }


class FirstTokenFilter:
    """Drops decode's copy of the first token (prefill streamed it) from vLLM's first outputs, text
    included (vLLM may emit the token's text later than the token, when it ends mid-character)."""

    def __init__(self, first_token: int, first_text: str) -> None:
        self._token: int | None = first_token
        self._text = first_text

    def __call__(self, token_ids: list[int], text: str) -> tuple[list[int], str]:
        if self._token is not None and token_ids:
            if token_ids[0] != self._token:
                raise DataLoss(
                    f"kv_cache: decode's first token {token_ids[0]} differs from prefill's {self._token}: "
                    "the KV it read is not the one prefill computed",
                    reason=Reason.KV_GONE,
                )
            token_ids, self._token = token_ids[1:], None
        if self._text:
            if text.startswith(self._text):
                text, self._text = text[len(self._text) :], ""
            elif self._text.startswith(text):
                text, self._text = "", self._text[len(text) :]
            else:
                self._text = ""
        return token_ids, text


class VllmDecode(DecodeBackend):
    """`DecodeBackend` on vLLM's AsyncLLM: decode of paged KV handoffs (KV consumer)."""

    name = "vllm"

    def __init__(self, settings: EngineSettings, planner: RequestPlanner) -> None:
        self._settings = settings
        self.planner = planner
        self.weights_digest = planner.checkpoint.weights_digest()
        self._producers = Producers(model_identity(settings, self.weights_digest))
        self._failure_dir = Path(tempfile.mkdtemp(prefix="epd-vllm-decode-"))
        self.supervisor = EngineSupervisor(self._build, EngineLife.of(settings), queued=lambda: self._active)
        # Requests beyond vLLM's batch (max_num_seqs = max_batch) wait in admission, not in vLLM: a
        # handoff's lease is checked before vLLM sees it, and vLLM reads the blocks as soon as it
        # takes the request; queued inside vLLM, a lease could expire (blocks reused) before the read.
        self.max_running = min(settings.max_running, settings.max_batch)
        self.in_flight = InFlight()
        self._active = 0

    def _build(self) -> Any:
        kv = runtime.KvTransfer(
            "kv_consumer", f"epd-decode-{secrets.token_hex(6)}", runtime.side_channel_port(self._settings)
        )
        return runtime.build_engine(self._settings, failure_dir=self._failure_dir, ec_consumer=False, kv=kv)

    def capabilities(self) -> tuple[str, ...]:
        return (PAGED_KV, capability(self.name))

    @property
    def active(self) -> int:
        """Requests in this service's streams, or still held by vLLM (a cancelled request is done
        only once vLLM aborted it and freed its blocks)."""
        held = int(self.supervisor.current().get_num_unfinished_requests()) if self.supervisor.alive else 0
        return max(self._active, held)

    def watch_health(self, setter: Any) -> None:
        self.supervisor.watch_health(setter)

    def watch_fatal(self, fail: Any) -> None:
        self.supervisor.watch_fatal(fail)

    def _block_bytes(self, llm: Any) -> int:
        """Bytes of one KV block over all layers (keys and values): what vLLM's connector reads
        per block id of a handoff."""
        import torch

        layers, heads, head_dim = self.planner.kv_dims()
        itemsize = int(getattr(torch, runtime.engine_dtype(llm)).itemsize)  # the engine's, not the embeddings'

        block_size = int(llm.vllm_config.cache_config.block_size)
        return block_size * layers * 2 * heads * head_dim * itemsize

    def _check(self, request: decode_pb2.DecodeRequest) -> dict[str, Any]:
        kv, state = request.kv_cache, request.decode_state
        if not kv.HasField("paged"):
            raise InvalidArgument("kv_cache.paged", "the vLLM engine continues from a paged KV cache of a vLLM prefill")
        if not state.HasField("engine_prompt"):
            raise InvalidArgument("decode_state.engine_prompt", "is required with kv_cache.paged")
        if kv.paged.lease_expire_time.ToNanoseconds() / 1e9 - time.time() < _EXPIRY_MARGIN_S:
            raise NotFound(
                "kv_cache.paged.lease_expire_time: the KV cache's lease expired; prefill freed its blocks",
                reason=Reason.KV_GONE,
            )
        layers, heads, head_dim = self.planner.kv_dims()
        got = (kv.layout.num_layers, kv.layout.num_kv_heads, kv.layout.head_dim)
        if got != (layers, heads, head_dim):
            raise FailedPrecondition(
                f"kv_cache.layout is {got} (layers, KV heads, head size); this model's is {(layers, heads, head_dim)}"
            )
        budget = kv.layout.num_tokens + (request.sampling.max_tokens or DEFAULT_MAX_TOKENS)
        if budget > self.planner.max_model_len:
            raise InvalidArgument(
                "sampling.max_tokens",
                f"prompt + max_tokens ({budget}) exceeds the model length {self.planner.max_model_len}",
            )
        layouts = [convert.item_layout_to_engine(layout) for layout in state.engine_prompt.items]
        return self.planner.plan_decode(
            state.engine_prompt.token_ids, layouts, "decode_state.engine_prompt", state.cache_salt
        )

    async def decode(
        self, request: decode_pb2.DecodeRequest, deadline: float | None
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        with self.in_flight.track(request.request_id):
            async with contextlib.aclosing(self._decode(request, deadline)) as stream:
                async for chunk, usage in stream:
                    response = decode_pb2.DecodeResponse(chunk=chunk)
                    if usage is not None:
                        response.usage.CopyFrom(usage)
                    yield response

    async def _decode(
        self, request: decode_pb2.DecodeRequest, deadline: float | None
    ) -> AsyncGenerator[tuple[generation_pb2.TokenChunk, generation_pb2.Usage | None], None]:
        prompt = await asyncio.to_thread(self._check, request)
        await self._producers.check(request.kv_cache.paged.producer_address)
        sampling = convert.sampling_to_engine(request.sampling)
        state = request.decode_state
        params = runtime.sampling_params(
            sampling,
            DEFAULT_MAX_TOKENS,
            {},
            seed=runtime.split_seed(sampling, request.request_id),
            kv_transfer_params=kv_transfer_params(request.kv_cache),
        )
        engine = self.supervisor.engine()
        llm = engine.llm
        skip_first = FirstTokenFilter(state.next_input_token_id, state.generated_text)
        generated = state.generated_tokens
        self._active += 1
        started = time.perf_counter()
        span = None
        try:
            stream = llm.generate(
                prompt, params, request.request_id, priority=runtime.engine_priority(request.priority)
            )
            with stage("kv.transfer", "transfer", **{"epd.engine": "vllm"}) as transfer:
                out = await engine.next(stream, deadline)  # the blocks read and the first step run
                blocks = sum(len(group.block_ids) for group in request.kv_cache.paged.groups)
                transfer.set_attribute("epd.transfer.blocks", blocks)
                record_transfer(
                    transfer,
                    nbytes=blocks * self._block_bytes(llm),
                    seconds=time.perf_counter() - started,
                    transport="nixl",
                    peers=1,
                    direction="prefill->decode",
                )
            span = start_phase("decode.generate", **{"epd.stage": "decode", "epd.engine": "vllm"})
            while True:
                if out.outputs[0].finish_reason == "error":
                    raise NotFound(
                        "kv_cache.paged: decode's engine could not read the KV cache from prefill (its blocks "
                        "are gone: released, expired, or the prefill engine restarted)",
                        reason=Reason.KV_GONE,
                    )
                chunk, finished = runtime.chunk(out, sampling.logprobs)
                token_ids, text = skip_first(list(chunk.token_ids), chunk.text)
                if chunk.logprobs:  # one per token: drop the first token's with it
                    del chunk.logprobs[: len(chunk.token_ids) - len(token_ids)]
                del chunk.token_ids[:]
                chunk.token_ids.extend(token_ids)
                chunk.text = text
                generated += len(token_ids)
                usage = None
                if finished:
                    usage = generation_pb2.Usage(
                        prompt_tokens=state.prompt_tokens,
                        completion_tokens=generated,
                        cached_prompt_tokens=state.cached_prompt_tokens,
                    )
                if token_ids or text or finished:
                    yield chunk, usage
                if finished:
                    return
                out = await engine.next(stream, deadline)
        except EpdError:
            raise
        except Exception as exc:
            raise runtime.engine_error(exc) from exc
        finally:
            self._active -= 1
            if span is not None:
                span.set_attribute("epd.decode.tokens", generated - state.generated_tokens)
                span.end()
                record_duration("decode.generate", "decode", time.perf_counter() - started)

    async def close(self) -> None:
        await self.supervisor.close()


async def start(settings: EngineSettings) -> VllmDecode:
    """Start vLLM's engine: a KV consumer."""
    runtime.refuse_unsupported(settings.model, "e/p/d")
    backend = VllmDecode(settings, RequestPlanner(settings.model, max_model_len=settings.max_model_len))
    await asyncio.to_thread(runtime.import_vllm, settings)  # before the start's clock runs: the import is slow
    await start_or_exit(backend.supervisor, backend.close)
    return backend
