"""vLLM itself: engine arguments, sampling parameters, outputs -> token chunks, errors -> status.

Import this module only in services that chose `--engine vllm` (importing vLLM takes 10-18 s).
Settings that matter on this machine (docs/engine.md, vLLM):
- loopback only: `VLLM_HOST_IP=127.0.0.1`, NIXL side channel on 127.0.0.1, UCX on `lo`;
- explicit KV-cache bytes (`kv_cache_memory_bytes`): vLLM would otherwise size it from RAM;
- `enforce_eager` (no graph capture on CPU), float32 (token-identical to the reference runs);
- torchvision: vLLM's processes are fresh interpreters, covered by libs/torchvision_guard.py's
  start-up hook; the model-inspection subprocess too (it is a plain `python -m`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from libs.contract.epd.v1 import generation_pb2
from libs.contract.errors import EpdError, InvalidArgument, Unavailable
from libs.engine import types as eng
from libs.engines.settings import EngineSettings
from libs.engines.vllm.requests import ItemDescriptor
from libs.serving.convert import chunk_to_wire

EC_CONNECTOR_MODULE = "libs.engines.vllm.ec_connector"


def loopback_environment() -> None:
    """Keep every vLLM process on loopback and quiet (set before the engine spawns them)."""
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("UCX_MODULES", "^ib")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    # The worker imports this project (the EC connector): make the checkout importable there.
    root = str(Path(__file__).resolve().parents[3])
    path = os.environ.get("PYTHONPATH", "")
    if root not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, path) if p)


def build_engine(settings: EngineSettings, *, failure_dir: Path, ec_consumer: bool) -> Any:
    """A started `AsyncLLM` (blocking: spawns EngineCore and Worker, loads weights)."""
    loopback_environment()
    from vllm.config import ECTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args: dict[str, Any] = dict(
        model=str(settings.model),
        served_model_name=settings.model_id or settings.model.name,
        dtype="float32",
        enforce_eager=True,
        kv_cache_memory_bytes=settings.kv_cache_mib << 20,
        max_model_len=settings.max_model_len,
        max_num_seqs=settings.max_batch,
        seed=0,
        disable_log_stats=True,
    )
    if ec_consumer:
        args["ec_transfer_config"] = ECTransferConfig(
            ec_connector="EpdECConnector",
            ec_connector_module_path=EC_CONNECTOR_MODULE,
            ec_role="ec_consumer",
            ec_connector_extra_config={"failure_dir": str(failure_dir)},
        )
    return AsyncLLM.from_engine_args(AsyncEngineArgs(**args))


def sampling_params(params: eng.SamplingParams, default_max_tokens: int, items: dict[str, ItemDescriptor]) -> Any:
    """The project's sampling as vLLM's, streaming deltas; the EC items ride in `extra_args`."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    extra: dict[str, Any] | None = None
    if items:
        extra = {"ec_transfer_params": {"epd_items": {uuid: item.to_dict() for uuid, item in items.items()}}}
    return SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=params.seed,
        max_tokens=params.max_tokens or default_max_tokens,
        stop=list(params.stop) or None,
        stop_token_ids=list(params.stop_token_ids) or None,
        output_kind=RequestOutputKind.DELTA,
        extra_args=extra,
    )


def chunk(out: Any) -> tuple[generation_pb2.TokenChunk, bool]:
    """One `RequestOutput` (delta) as a TokenChunk; whether it is the last."""
    completion = out.outputs[0]
    reason: eng.FinishReason | None = None
    if completion.finish_reason == "stop":
        reason = eng.FinishReason.STOP_SEQUENCE if isinstance(completion.stop_reason, str) else eng.FinishReason.STOP
    elif completion.finish_reason == "length":
        reason = eng.FinishReason.LENGTH
    elif completion.finish_reason is not None:  # "abort", "error": the engine gave up on it
        raise Unavailable(f"vLLM finished the request with {completion.finish_reason!r}")
    text = completion.text or ""
    return chunk_to_wire(eng.TokenChunk(list(completion.token_ids), text, reason)), reason is not None


def engine_error(exc: BaseException) -> EpdError:
    """vLLM's exceptions as typed statuses: a dead engine is UNAVAILABLE (it restarts), a request
    vLLM refuses is INVALID_ARGUMENT."""
    from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

    if isinstance(exc, EngineDeadError | EngineGenerateError):
        return Unavailable(f"vLLM engine failed ({type(exc).__name__}); it is restarting")
    if isinstance(exc, ValueError):
        return InvalidArgument("request", f"vLLM refused the request: {exc}")
    return Unavailable(f"vLLM request failed: {type(exc).__name__}: {exc}")
