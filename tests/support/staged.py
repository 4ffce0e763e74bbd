"""Staged execution across E, P and D processes, checked against the model's own generate()."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from libs.model.content import media_hash
from libs.model.media.limits import MediaLimits
from libs.model.prompt import build_prompt
from libs.model.types import ChatMessage, ChatRole, EncodedItem, EncodedPart, TextPart
from libs.runtime.lm_runtime import LanguageModelRuntime
from tests.support import wire
from tests.support.mixes import Mix
from tests.support.reference import reference_generate, reference_inputs
from tests.support.stages import StageProcess, close_all

MAX_TOKENS = 8


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def run_staged(
    runs: dict[str, tuple[Path, list[Mix]]], while_starting: Callable[[], object] | None = None
) -> dict[str, dict[str, Any]]:
    """Per family: encode in E, prefill in P, decode all its mixes together in D. One process per
    role serves every family; only bytes cross processes. `while_starting` runs here while the
    stage processes start."""
    paths = [path for path, _ in runs.values()]
    stages = {role: StageProcess(role, paths) for role in ("encoder", "prefill", "decode")}
    try:
        if while_starting is not None:
            while_starting()
        for stage in stages.values():
            stage.wait_ready()
        pids = {role: stage.ready["pid"] for role, stage in stages.items()}
        out = {family: _run_family(stages, str(path), mixes) | {"pids": pids} for family, (path, mixes) in runs.items()}
    finally:
        close_all(list(stages.values()))
    return out


def _run_family(stages: dict[str, StageProcess], model: str, mixes: list[Mix]) -> dict[str, Any]:
    prefill_out: dict[str, Any] = {}
    decode_requests, decode_tensors = [], {}
    for mix in mixes:
        layouts: list[dict[str, Any]] = []
        item_tensors: dict[str, torch.Tensor] = {}
        if mix.media:
            head, tensors = stages["encoder"].call(
                {
                    "op": "encode",
                    "model": model,
                    "items": [{"modality": m.modality.value, "item_index": m.item_index} for m in mix.media],
                },
                {f"media{i}": torch.frombuffer(bytearray(m.data), dtype=torch.uint8) for i, m in enumerate(mix.media)},
            )
            layouts, item_tensors = head["layouts"], tensors
        parts = [{"text": p} if isinstance(p, str) else {"item": p} for p in mix.parts]
        head, tensors = stages["prefill"].call(
            {"op": "prefill", "model": model, "layouts": layouts, "requests": [
                {"messages": [{"role": "user", "parts": parts}], "sampling": {"max_tokens": MAX_TOKENS}}]},
            item_tensors,
        )  # fmt: skip
        result = head["results"][0]
        prefill_out[mix.name] = {"result": result, "logits": tensors["r0/logits"], "layouts": layouts}
        prefill_out[mix.name]["item_tensors"] = sorted(item_tensors)
        if "kv_layout" in result:
            j = len(decode_requests)
            request = {"id": mix.name, "state": result["state"], "kv_layout": result["kv_layout"]}
            request.update(digest=result["digest"], sampling={"max_tokens": MAX_TOKENS})
            decode_requests.append(request)
            decode_tensors.update({f"r{j}/{k[3:]}": v for k, v in tensors.items() if k.startswith("r0/kv/")})
    decode_head, decode_out = stages["decode"].call(
        {"op": "decode", "model": model, "requests": decode_requests}, decode_tensors
    )
    loaded = {role: stage.call({"op": "loaded", "model": model})[0] for role, stage in stages.items()}
    return {"prefill": prefill_out, "decode": decode_head, "decode_logits": decode_out, "loaded": loaded}


def reference_for(
    model: Any, runtime: LanguageModelRuntime, encoder_adapter: Any, mix: Mix, layouts: list[dict[str, Any]]
) -> tuple[list[int], list[torch.Tensor]]:
    """The colocated model's greedy tokens and per-step logits for one mix, its inputs made by the
    family's transformers processor. The project's prompt for the mix must be the processor's."""
    prepared = [encoder_adapter.preprocess(m, media_hash(m), MediaLimits()) for m in mix.media]
    assert [p.layout for p in prepared] == [wire.layout_from_dict(d) for d in layouts]
    items = [EncodedItem(p.layout, {"embeddings": torch.zeros(p.layout.placeholder_token_count, 1)}) for p in prepared]
    parts = tuple(TextPart(p) if isinstance(p, str) else EncodedPart(items[p]) for p in mix.parts)
    prompt = build_prompt(runtime.tokenizer, runtime.adapter, [ChatMessage(ChatRole.USER, parts)])
    kwargs = reference_inputs(runtime.checkpoint.path, mix)
    assert prompt.input_ids == kwargs["input_ids"][0].tolist(), f"{mix.name}: prompt ids differ from the processor's"
    return reference_generate(model, kwargs, MAX_TOKENS)
