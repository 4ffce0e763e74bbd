"""vLLM itself: engine arguments, sampling parameters, outputs -> token chunks, errors -> status.

Import this module only in services that chose `--engine vllm` (importing vLLM takes seconds).
Every engine setting comes from the service's settings (libs/backends/settings.py; the table in
docs/vllm-operations.md), today's CPU values as defaults:
- host: `VLLM_HOST_IP` and the NIXL side channel on `--engine-host-ip` (default `--host`), UCX on
  `--ucx-net-devices` / `--ucx-tls` (default `lo`: this host only);
- device (`--device`, the installed vLLM build's), dtype (float32: token-identical to the
  reference runs), eager or graphs, tensor-parallel size;
- KV cache: explicit bytes (`--kv-cache-mib`; vLLM would otherwise size it from RAM) or vLLM's
  memory fraction (`--gpu-memory-utilization`);
- torchvision: vLLM's processes are fresh interpreters, covered by libs/torchvision_guard.py's
  start-up hook; the model-inspection subprocess too (it is a plain `python -m`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from libs.backends.engines import model_type, refusal
from libs.backends.settings import (
    ChunkedEngineSettings,
    EncoderBackendSettings,
    EngineSettings,
    PrefillDecodeEngineSettings,
)
from libs.backends.vllm import engine_polling, patches, plugin
from libs.backends.vllm.plugin import WHISPER_ARCHITECTURE, WHISPER_LOGITS
from libs.backends.vllm.shared_pool import SlotDescriptor
from libs.contract.epd.v1 import generation_pb2
from libs.contract.errors import EpdError, InvalidArgument, Unavailable
from libs.contract.reasons import Reason
from libs.contract.validation import HELD_ITEMS_CAPABILITY
from libs.model import types as eng
from libs.model.checkpoint import Checkpoint
from libs.serving.convert import chunk_to_wire

EC_CONNECTOR_MODULE = "libs.backends.vllm.ec_connector"
EC_PRODUCER_MODULE = "libs.backends.vllm.ec_producer"
KV_CONNECTOR_MODULE = "libs.backends.vllm.kv_connector"


def process_environment() -> None:
    """Quiet vLLM and NIXL, and make this checkout importable in vLLM's processes (the worker loads
    the project's connectors). The operator's environment wins here (setdefault)."""
    os.environ.setdefault("UCX_MODULES", "^ib")  # as libs/transfer's agents (TransferConfig.ucx_modules)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    root = str(Path(__file__).resolve().parents[3])
    path = os.environ.get("PYTHONPATH", "")
    if root not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, path) if p)


def engine_host(settings: EngineSettings) -> str:
    """The address peers reach this engine at (its NIXL side channel, vLLM's own host IP)."""
    return settings.engine_host_ip or settings.host


def engine_environment(settings: EngineSettings, kv: KvTransfer | None = None) -> dict[str, str]:
    """What vLLM's processes (EngineCore, Worker) read from their environment, from the service's
    settings: set before the engine spawns them, and over the operator's (the settings say it).

    - host: `VLLM_HOST_IP` and the NIXL side channel (served by EngineCore, advertised in every KV
      handoff as `remote_host`: decode dials it) on the engine's address;
    - UCX: the devices and transports vLLM's NIXL agent (the KV) moves bytes over, as the project's
      agents do (`--ucx-net-devices`, `--ucx-tls`);
    - CPU only: vLLM binds its worker's OpenMP threads to cores itself: with a KV connector on a
      host with few cores it takes every core (it reserves one more for transfers, finds none
      left, and binds to all), and each engine binds the same cores. Unbound, with the service's
      thread count, the engines of one host share the cores through the OS scheduler;
    - how long EngineCore and Worker poll each other before they sleep (`--engine-busy-poll-s`,
      `engine_polling.py`);
    - the worker inside EngineCore (`executor_backend`): vLLM's CPU platform turns "uni" into "mp"
      unless `VLLM_ENABLE_V1_MULTIPROCESSING` is 0 (read where the engine's config is built: this
      process). AsyncLLM still runs EngineCore in a process of its own."""
    host = engine_host(settings)
    env = {"VLLM_HOST_IP": host, "VLLM_NIXL_SIDE_CHANNEL_HOST": host, "UCX_NET_DEVICES": settings.ucx_net_devices}
    if settings.ucx_tls:
        env["UCX_TLS"] = settings.ucx_tls
    if kv is not None:
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(kv.side_channel_port)
    if settings.engine_busy_poll_s >= 0:
        env[engine_polling.ENV] = str(settings.engine_busy_poll_s)
    if settings.device == "cpu":
        env |= {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(max(1, settings.torch_threads))}
        if executor_backend(settings) == "uni":
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


def executor_backend(settings: EngineSettings) -> str | None:
    """vLLM's `distributed_executor_backend` for the engine (None: vLLM's choice). On CPU vLLM
    spawns a Worker beside EngineCore, and the two poll each other's shared-memory queue at every
    step (`engine_polling.py`); on a small host the pollers take the cores the forward needs. With
    one device the worker can live inside EngineCore instead, as vLLM runs one GPU: one process,
    no queue between them to poll (docs/vllm.md, "One engine process")."""
    if settings.distributed_executor_backend != "auto":
        return settings.distributed_executor_backend
    if settings.device == "cpu" and settings.tensor_parallel_size == 1:
        return "uni"
    return None


@dataclass(frozen=True)
class KvTransfer:
    """The engine's side of a P->D KV handoff (vLLM's NixlConnector through the project's
    subclass): `kv_producer` (prefill) or `kv_consumer` (decode)."""

    role: Literal["kv_producer", "kv_consumer"]
    engine_id: str  # new at every engine start: a consumer's handshake checks it
    side_channel_port: int  # where the engine serves its NIXL agent metadata


def refuse_unsupported(model: Path, layout: str) -> None:
    """A checkpoint this engine must not serve in `layout` ends the service at start-up, naming the
    pairing (before vLLM is imported or anything loaded)."""
    if (why := refusal("vllm", model_type(model), layout)) is not None:
        raise SystemExit(f"epd: {why}")


def import_vllm(settings: EngineSettings) -> None:
    """Import vLLM's engine once per process, before an engine start is timed (the import takes
    seconds; `engine_start_timeout_s` bounds the engine's start, not the import). Ends the service
    at start-up, naming what to do, on a vLLM the project cannot run as installed: another version
    than its patches were checked against (patches.py), a `VLLM_PLUGINS` that leaves the project's
    plugin out of vLLM's engine processes, a build for another device than `--device`. The plugin
    runs here too (vLLM would run it at the engine's start): this process's patches are in place
    before the engine parses a request."""
    process_environment()
    try:
        patches.check_plugin_enabled()
        plugin.register()
    except patches.VllmSetupError as exc:
        raise SystemExit(f"epd: {exc}") from None
    from vllm.platforms import current_platform
    from vllm.v1.engine.async_llm import AsyncLLM  # noqa: F401

    built_for = str(current_platform.device_type)
    if built_for != settings.device:
        raise SystemExit(
            f"epd: --device {settings.device}, but the installed vLLM is the {built_for or 'unknown'} build: "
            "install the vLLM wheel of that device (docs/vllm-operations.md, install variants)"
        )


def side_channel_port(settings: EngineSettings) -> int:
    """The NIXL side-channel port of an engine start: the fixed one, or one free on the engine's
    address now (a restart gets a new one: the old engine's socket may linger)."""
    if settings.nixl_side_channel_port:
        return settings.nixl_side_channel_port
    with socket.socket() as sock:
        sock.bind((engine_host(settings), 0))
        return int(sock.getsockname()[1])


def engine_args(
    settings: EngineSettings,
    *,
    failure_dir: Path,
    ec_consumer: bool,
    kv: KvTransfer | None = None,
    ec_producer: bool = False,
) -> dict[str, Any]:
    """vLLM's engine arguments from the service's settings (plain values; the two transfer configs
    as dicts of their fields, made vLLM's config objects by `build_engine`)."""
    args: dict[str, Any] = dict(
        model=str(settings.model),
        served_model_name=settings.model_id or settings.model.name,
        dtype=settings.dtype,
        enforce_eager=settings.enforce_eager,
        tensor_parallel_size=settings.tensor_parallel_size,
        max_model_len=settings.max_model_len,
        max_num_seqs=settings.max_batch,
        seed=0,
        # EPD's priority (higher first) inside vLLM's scheduler too: requests waiting in vLLM (a
        # full batch, a full KV cache) start by priority, and preemption picks the lowest.
        scheduling_policy="priority",
        # vLLM's scheduler gauges (vllm:kv_cache_usage_perc, vllm:num_requests_running/waiting, ...)
        # land in prometheus_client's registry, which the service's /metrics serves (docs/tracing.md).
        disable_log_stats=False,
    )
    if (backend := executor_backend(settings)) is not None:
        args["distributed_executor_backend"] = backend
    if settings.max_num_batched_tokens > 0:
        args["max_num_batched_tokens"] = settings.max_num_batched_tokens
    if settings.gpu_memory_utilization > 0:
        args["gpu_memory_utilization"] = settings.gpu_memory_utilization  # vLLM sizes the KV cache
    else:
        args["kv_cache_memory_bytes"] = settings.kv_cache_mib << 20  # else vLLM sizes it from all RAM
    if model_type(settings.model) == "whisper":
        args |= speech_engine_args(settings)
    if isinstance(settings, ChunkedEngineSettings):
        # The reference engine's prefill chunks, in vLLM's scheduler: while other requests are
        # running or waiting, one prompt gets at most this many tokens of a step, so a short text
        # request is not held behind a whole multimodal prefill (a lone prompt still runs whole);
        # on the PD, with the fair share, more when few requests share the step's budget.
        args["long_prefill_token_threshold"] = min(settings.prefill_chunk_tokens, args["max_model_len"])
        args["long_prefill_token_threshold_adaptive"] = (
            isinstance(settings, PrefillDecodeEngineSettings) and settings.prefill_chunk_fair_share
        )
    if ec_consumer:
        args["ec_transfer_config"] = dict(
            ec_connector="EpdECConnector",
            ec_connector_module_path=EC_CONNECTOR_MODULE,
            ec_role="ec_consumer",
            # The embeddings are in the service's shared pool (read there over NIXL, as the
            # service's transport settings say); the worker only copies them.
            ec_connector_extra_config={"failure_dir": str(failure_dir)},
        )
    if ec_producer:
        # The encoder (E): the tower only, its outputs written into the service's shared pool by
        # the project's producer connector. No prefix caching: every item is encoded (and written).
        args["mm_encoder_only"] = True
        args["enable_prefix_caching"] = False
        # Every item's uuid is unique (encoder.py), so vLLM's processor cache never hits: off, the
        # engine's process keeps no copy of every item's pixels (up to 4 GiB by default).
        args["mm_processor_cache_gb"] = 0
        if isinstance(settings, EncoderBackendSettings):
            # One Encode call is one vLLM request here (all its items): the calls one tower step
            # takes are its sequences, bounded by --encode-batch-items as the reference encoder's
            # batches are (vLLM's token budget bounds their items further).
            args["max_num_seqs"] = settings.encode_batch_items
        args["ec_transfer_config"] = dict(
            ec_connector="EpdECProducer",
            ec_connector_module_path=EC_PRODUCER_MODULE,
            ec_role="ec_producer",
            ec_connector_extra_config={"failure_dir": str(failure_dir)},
        )
    if kv is not None:
        args["kv_transfer_config"] = dict(
            kv_connector="EpdNixlConnector",
            kv_connector_module_path=KV_CONNECTOR_MODULE,
            kv_role=kv.role,
            kv_buffer_device=settings.device,  # the KV is read where the engine keeps it
            engine_id=kv.engine_id,
            kv_load_failure_policy="fail",  # "recompute" would run the vision tower on metadata-only items
            kv_connector_extra_config={"num_threads": 1, "kv_lease_duration": max(1, int(settings.lease_ttl_s))},
        )
        args["worker_extension_cls"] = f"{KV_CONNECTOR_MODULE}.EpdKvWorkerExtension"
    return args


def speech_engine_args(settings: EngineSettings) -> dict[str, Any]:
    """Whisper (a PD service): the project's Whisper model, which takes the encoder states EPD's
    encoder made as its audio item, and generate()'s logits processors (whisper_model.py,
    registered by the project's vLLM plugin); the decoder's positions bound the model length."""
    positions = int(Checkpoint(settings.model).config.get("max_target_positions", settings.max_model_len))
    return dict(
        hf_overrides={"architectures": [WHISPER_ARCHITECTURE]},
        enable_mm_embeds=True,
        logits_processors=[WHISPER_LOGITS],
        max_model_len=min(settings.max_model_len, positions),
    )


def build_engine(
    settings: EngineSettings,
    *,
    failure_dir: Path,
    ec_consumer: bool,
    kv: KvTransfer | None = None,
    ec_producer: bool = False,
) -> Any:
    """A started `AsyncLLM` (blocking: spawns EngineCore, and a Worker unless the worker runs
    inside it, `executor_backend`; loads weights). Call it on a thread of its own (the supervisor's
    start thread): with `engine_cpus` that thread takes them while it spawns the engine's processes,
    which inherit them; this process's threads keep the service's CPUs."""
    process_environment()
    service_cpus = os.sched_getaffinity(0)
    if settings.engine_cpus:
        os.sched_setaffinity(0, settings.engine_cpus)  # 0: this thread only
    # Read by the spawned processes (the worker reads its own copy of the environment too).
    os.environ.update(engine_environment(settings, kv))
    from vllm.config import ECTransferConfig, KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = engine_args(settings, failure_dir=failure_dir, ec_consumer=ec_consumer, kv=kv, ec_producer=ec_producer)
    if "ec_transfer_config" in args:
        args["ec_transfer_config"] = ECTransferConfig(**args["ec_transfer_config"])
    if "kv_transfer_config" in args:
        args["kv_transfer_config"] = KVTransferConfig(**args["kv_transfer_config"])
    try:
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
    finally:
        if settings.engine_cpus:  # threads started meanwhile (ZMQ's I/O) serve this process
            place_threads(service_cpus)


def place_threads(cpus: set[int]) -> None:
    """Every thread of this process onto `cpus` (one that ends meanwhile is skipped)."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(tid), cpus)


def engine_dtype(llm: Any) -> str:
    """The dtype a started engine computes and keeps its KV cache in ("float32", "bfloat16", ...):
    `--dtype` as vLLM resolved it ("auto": the checkpoint's, per device)."""
    return str(llm.vllm_config.model_config.dtype).removeprefix("torch.")


def engine_priority(priority: int) -> int:
    """epd.v1's priority (higher is served first) as vLLM's (lower is scheduled first)."""
    return -priority


def split_seed(params: eng.SamplingParams, request_id: str) -> int | None:
    """The seed of a request split over two engines. Decode's engine samples the first token again
    (it recomputes the prompt's last token), so both engines must draw the same one: a request
    sampled without a seed gets one derived from its id, which prefill and decode both know."""
    if params.seed is not None or params.temperature == 0:
        return params.seed
    return int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:4], "big") & 0x7FFFFFFF


def held_items(adapter: Any) -> tuple[str, ...]:
    """`prefix.held_items` (contract 1.9) for a language-model engine with vLLM's prefix cache: the EC
    connector refuses a held item its hit does not cover (ec_connector.py). Encoder-decoder models
    keep no prefix."""
    return () if adapter.is_encoder_decoder else (HELD_ITEMS_CAPABILITY,)


def salted(prompt: dict[str, Any], cache_salt: str) -> dict[str, Any]:
    """The prompt scoped to the request's tenant in vLLM's prefix cache (its `cache_salt`: mixed
    into the first block's hash, so no block is shared across salts)."""
    return {**prompt, "cache_salt": cache_salt} if cache_salt else prompt


def sampling_params(
    params: eng.SamplingParams,
    default_max_tokens: int,
    items: dict[str, SlotDescriptor],
    *,
    seed: int | None = None,
    max_tokens: int | None = None,
    kv_transfer_params: dict[str, Any] | None = None,
    extra_args: dict[str, Any] | None = None,
    request_id: str = "",
) -> Any:
    """The project's sampling as vLLM's, streaming deltas; the EC items, the KV handoff and
    `extra_args` ride in `extra_args`. `seed` and `max_tokens` override the request's (P/D split)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    extra: dict[str, Any] = dict(extra_args or {})
    if items or request_id:
        extra["ec_transfer_params"] = {
            "epd_items": {uuid: item.to_dict() for uuid, item in items.items()},
            "epd_request_id": request_id,  # where the EC connector reports a held item's miss
        }
    if kv_transfer_params is not None:
        extra["kv_transfer_params"] = kv_transfer_params
    cap = max_tokens or params.max_tokens or default_max_tokens
    return SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=params.seed if seed is None else seed,
        max_tokens=cap,
        stop=list(params.stop) or None,
        stop_token_ids=list(params.stop_token_ids) or None,
        # Contract 1.6: vLLM's own knobs, the same names and meaning. min_tokens is clamped to
        # this call's cap (prefill's 1, or a server default below it): vLLM refuses more.
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        min_tokens=min(params.min_tokens, cap),
        ignore_eos=params.ignore_eos,
        logprobs=params.logprobs,
        output_kind=RequestOutputKind.DELTA,
        extra_args=extra or None,
    )


def logprobs_of(completion: Any, k: int | None) -> list[eng.TokenLogprobs] | None:
    """vLLM's per-token logprobs (a dict per position: the sampled token and the top k, by rank) as
    the contract's; None when the request asked for none."""
    if k is None or completion.logprobs is None:
        return None
    out = []
    for token_id, position in zip(completion.token_ids, completion.logprobs, strict=False):

        def entry(tid: int, logprob: Any) -> eng.TokenLogprob:
            return eng.TokenLogprob(tid, float(logprob.logprob), logprob.decoded_token or "")

        ranked = sorted((lp.rank, tid, lp) for tid, lp in position.items() if lp.rank is not None and lp.rank <= k)
        out.append(eng.TokenLogprobs(entry(token_id, position[token_id]), tuple(entry(t, lp) for _, t, lp in ranked)))
    return out


def chunk(out: Any, logprobs: int | None = None) -> tuple[generation_pb2.TokenChunk, bool]:
    """One `RequestOutput` (delta) as a TokenChunk, with the `logprobs` most likely alternatives
    per token when the request asked; whether it is the last."""
    completion = out.outputs[0]
    reason: eng.FinishReason | None = None
    if completion.finish_reason == "stop":
        reason = eng.FinishReason.STOP_SEQUENCE if isinstance(completion.stop_reason, str) else eng.FinishReason.STOP
    elif completion.finish_reason == "length":
        reason = eng.FinishReason.LENGTH
    elif completion.finish_reason is not None:  # "abort", "error": the engine gave up on it
        raise Unavailable(f"vLLM finished the request with {completion.finish_reason!r}")
    text = completion.text or ""
    entries = logprobs_of(completion, logprobs)
    return chunk_to_wire(eng.TokenChunk(list(completion.token_ids), text, reason, entries)), reason is not None


def engine_error(exc: BaseException) -> EpdError:
    """vLLM's exceptions as typed statuses: a dead engine is UNAVAILABLE (it restarts), a request
    vLLM refuses is INVALID_ARGUMENT."""
    from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

    if isinstance(exc, EngineDeadError | EngineGenerateError):
        return Unavailable(
            f"vLLM engine failed ({type(exc).__name__}); it is restarting", reason=Reason.ENGINE_RESTARTING
        )
    if isinstance(exc, ValueError):
        return InvalidArgument("request", f"vLLM refused the request: {exc}")
    return Unavailable(f"vLLM request failed: {type(exc).__name__}: {exc}")
