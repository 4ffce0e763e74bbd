"""Staged execution across E, P and D processes, checked against the model's own generate()."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from libs.engine.encoder_runner import media_hash
from libs.engine.lm_runtime import LanguageModelRuntime
from libs.engine.media.limits import MediaLimits
from libs.engine.prompt import build_prompt
from libs.engine.types import ChatMessage, ChatRole, EncodedItem, EncodedPart, TextPart
from tests.engine import wire
from tests.engine.mixes import Mix
from tests.engine.reference import reference_generate, reference_inputs
from tests.engine.stages import StageProcess

MAX_TOKENS = 8


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def run_staged(model_path: Path, mixes: list[Mix]) -> dict[str, Any]:
    """Encode in E, prefill in P, decode all mixes together in D; only bytes cross processes."""
    stages = {role: StageProcess(role, model_path) for role in ("encoder", "prefill", "decode")}
    try:
        for stage in stages.values():
            stage.wait_ready()
        pids = {role: stage.ready["pid"] for role, stage in stages.items()}
        prefill_out: dict[str, Any] = {}
        decode_requests, decode_tensors = [], {}
        for mix in mixes:
            layouts: list[dict[str, Any]] = []
            item_tensors: dict[str, torch.Tensor] = {}
            if mix.media:
                head, tensors = stages["encoder"].call(
                    {
                        "op": "encode",
                        "items": [{"modality": m.modality.value, "item_index": m.item_index} for m in mix.media],
                    },
                    {
                        f"media{i}": torch.frombuffer(bytearray(m.data), dtype=torch.uint8)
                        for i, m in enumerate(mix.media)
                    },
                )
                layouts, item_tensors = head["layouts"], tensors
            parts = [{"text": p} if isinstance(p, str) else {"item": p} for p in mix.parts]
            head, tensors = stages["prefill"].call(
                {"op": "prefill", "layouts": layouts, "requests": [
                    {"messages": [{"role": "user", "parts": parts}], "sampling": {"max_tokens": MAX_TOKENS}}]},
                item_tensors,
            )  # fmt: skip
            result = head["results"][0]
            prefill_out[mix.name] = {"result": result, "logits": tensors["r0/logits"], "layouts": layouts}
            if "kv_layout" in result:
                j = len(decode_requests)
                request = {"id": mix.name, "state": result["state"], "kv_layout": result["kv_layout"]}
                request.update(digest=result["digest"], sampling={"max_tokens": MAX_TOKENS})
                decode_requests.append(request)
                decode_tensors.update({f"r{j}/{k[3:]}": v for k, v in tensors.items() if k.startswith("r0/kv/")})
        decode_head, decode_out = stages["decode"].call({"op": "decode", "requests": decode_requests}, decode_tensors)
        loaded = {role: stage.call({"op": "loaded"})[0] for role, stage in stages.items()}
    finally:
        for stage in stages.values():
            stage.close()
    return {"prefill": prefill_out, "decode": decode_head, "decode_logits": decode_out, "loaded": loaded, "pids": pids}


def reference_for(
    model: Any, runtime: LanguageModelRuntime, encoder_adapter: Any, mix: Mix, layouts: list[dict[str, Any]]
) -> tuple[list[int], list[torch.Tensor]]:
    """The colocated model's greedy tokens and per-step logits for one mix."""
    prepared = [encoder_adapter.preprocess(m, media_hash(m), MediaLimits()) for m in mix.media]
    items = [EncodedItem(p.layout, {"embeddings": torch.zeros(p.layout.placeholder_token_count, 1)}) for p in prepared]
    parts = tuple(TextPart(p) if isinstance(p, str) else EncodedPart(items[p]) for p in mix.parts)
    prompt = build_prompt(runtime.tokenizer, runtime.adapter, [ChatMessage(ChatRole.USER, parts)])
    order = [prepared[next(i for i, it in enumerate(items) if it is e)] for e in prompt.encoded]
    assert [p.layout for p in prepared] == [wire.layout_from_dict(d) for d in layouts]
    return reference_generate(model, reference_inputs(prompt.input_ids, order), MAX_TOKENS)
