"""One engine stage in its own process, driven over stdin/stdout with `wire` frames. The process
holds one runner per model (one process per role serves every family under test, so the torch
import is paid once); each request names its model by path.

python -m tests.support.stage_worker {encoder|prefill|decode} MODEL_PATH [MODEL_PATH ...]
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from libs.model.errors import EngineError
from libs.model.types import (
    ChatMessage,
    ChatRole,
    EncodedItem,
    EncodedPart,
    KvCache,
    MediaInput,
    Modality,
    ProcessorOptions,
    SamplingParams,
    TextPart,
)
from libs.runtime.decode_runner import DecodeRunner
from libs.runtime.encoder_runner import EncoderRunner
from libs.runtime.lm_runtime import LanguageModelRuntime
from libs.runtime.prefill_runner import PrefillRunner
from tests.support import wire


def _sampling(d: dict[str, Any]) -> SamplingParams:
    return SamplingParams(
        **{**d, "stop": tuple(d.get("stop", ())), "stop_token_ids": tuple(d.get("stop_token_ids", ()))}
    )


def _sub(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}


def handle_encoder(runner: EncoderRunner, op: str, head: dict[str, Any], tensors: dict[str, torch.Tensor]) -> bytes:
    if op == "loaded":
        keys = sorted(runner.module.state_dict())
        specs = {m.value: [s.width, s.dtype] for m, s in runner.specs.items()}
        return wire.pack({"loaded": sorted(runner.checkpoint.loaded_names), "module_keys": keys, "specs": specs})
    items = [
        MediaInput(
            Modality(d["modality"]),
            tensors[f"media{i}"].numpy().tobytes(),
            item_index=d["item_index"],
            options=ProcessorOptions(**d.get("options", {})),
        )
        for i, d in enumerate(head["items"])
    ]
    encoded = runner.encode(items)
    out = {f"item{i}/{name}": t for i, item in enumerate(encoded) for name, t in item.tensors.items()}
    return wire.pack({"layouts": [wire.layout_to_dict(item.layout) for item in encoded]}, out)


def handle_prefill(runner: PrefillRunner, op: str, head: dict[str, Any], tensors: dict[str, torch.Tensor]) -> bytes:
    if op == "loaded":
        keys = sorted(runner.runtime.module.state_dict())
        return wire.pack({"loaded": sorted(runner.runtime.checkpoint.loaded_names), "module_keys": keys})
    items = [EncodedItem(wire.layout_from_dict(d), _sub(tensors, f"item{k}/")) for k, d in enumerate(head["layouts"])]
    results, out = [], {}
    for j, request in enumerate(head["requests"]):
        messages = [
            ChatMessage(
                ChatRole(m["role"]),
                tuple(TextPart(p["text"]) if "text" in p else EncodedPart(items[p["item"]]) for p in m["parts"]),
            )
            for m in request["messages"]
        ]
        result = runner.prefill(messages, _sampling(request["sampling"]), return_logits=True)
        chunk = result.first_chunk
        entry: dict[str, Any] = {
            "first": {"token_ids": chunk.token_ids, "text": chunk.text,
                      "finish": chunk.finish_reason.value if chunk.finish_reason else None},
            "state": wire.asdict(result.decode_state),
        }  # fmt: skip
        assert result.logits is not None
        out[f"r{j}/logits"] = result.logits
        if result.kv_cache is not None:
            entry["kv_layout"] = wire.asdict(result.kv_cache.layout)
            entry["digest"] = result.kv_cache.weights_digest
            out.update({f"r{j}/kv/{k}": v for k, v in result.kv_cache.tensors.items()})
        results.append(entry)
    return wire.pack({"results": results}, out)


def handle_decode(runner: DecodeRunner, op: str, head: dict[str, Any], tensors: dict[str, torch.Tensor]) -> bytes:
    if op == "loaded":
        keys = sorted(runner.runtime.module.state_dict())
        return wire.pack({"loaded": sorted(runner.runtime.checkpoint.loaded_names), "module_keys": keys})
    batch_sizes = []
    for j, request in enumerate(head["requests"]):
        kv = KvCache(wire.kv_layout_from_dict(request["kv_layout"]), _sub(tensors, f"r{j}/kv/"), request["digest"])
        runner.add(request["id"], kv, wire.state_from_dict(request["state"]), _sampling(request["sampling"]))
    results: dict[str, Any] = {a: {"tokens": [], "text": "", "finish": None} for a in runner.active_ids}
    logits: dict[str, list[torch.Tensor]] = {a: [] for a in runner.active_ids}
    while runner.active_ids:
        batch_sizes.append(len(runner.active_ids))
        for request_id, (chunk, row) in runner.step(return_logits=True).items():
            results[request_id]["tokens"] += chunk.token_ids
            results[request_id]["text"] += chunk.text
            if chunk.finish_reason:
                results[request_id]["finish"] = chunk.finish_reason.value
            assert row is not None
            logits[request_id].append(row)
    out = {f"{a}/logits": torch.stack(rows) for a, rows in logits.items()}
    return wire.pack({"results": results, "batch_sizes": batch_sizes}, out)


def _runner(role: str, model_path: str) -> Any:
    if role == "encoder":
        return EncoderRunner(model_path)
    if role == "prefill":
        return PrefillRunner(LanguageModelRuntime(model_path))
    return DecodeRunner(LanguageModelRuntime(model_path))


def main() -> None:
    role, model_paths = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(1)  # several stage processes share two cores
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing else may write into the frame stream
    handler = {"encoder": handle_encoder, "prefill": handle_prefill, "decode": handle_decode}[role]
    runners = {path: _runner(role, path) for path in model_paths}
    wire.write_frame(stdout, wire.pack({"ready": True, "pid": os.getpid(), "role": role}))
    while True:
        try:
            head, tensors = wire.unpack(wire.read_frame(stdin))
        except EOFError:
            return
        op = head["op"]
        if op == "exit":
            return
        try:
            reply = handler(runners[head["model"]], op, head, tensors)
        except EngineError as exc:
            reply = wire.pack(
                {"error": type(exc).__name__, "kind": exc.kind.value, "message": str(exc), "field": exc.field}
            )
        wire.write_frame(stdout, reply)


if __name__ == "__main__":
    main()
