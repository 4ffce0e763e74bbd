"""Whisper on vLLM before vLLM sees anything (no vLLM needed): which layouts serve the pairing, the
engine's arguments, and the request planner on the converted tiny.en checkpoint - one item of
encoder states and no text, as the reference runtime checks it, refused with a typed status naming
the field; the decoder prompt generate() starts from. Its live counterpart is
test_whisper_on_vllm.py (transcripts through a real stack equal generate()'s)."""

from __future__ import annotations

import asyncio
import importlib
import json
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch

from libs.backends.engines import refusal
from libs.backends.settings import EngineSettings
from libs.backends.vllm import runtime
from libs.backends.vllm.plugin import WHISPER_ARCHITECTURE, WHISPER_LOGITS
from libs.backends.vllm.requests import RequestPlanner, with_encoder_states
from libs.contract.epd.v1 import chat_pb2, layout_pb2, media_pb2, tensor_pb2
from libs.contract.errors import EpdError, InvalidArgument
from libs.model import types as eng
from libs.model.checkpoints.generate import ensure_converted

ROWS, WIDTH = 1500, 384  # tiny.en: encoder states per 30 s window


@pytest.fixture(scope="module")
def whisper() -> Path:
    return ensure_converted()


@pytest.fixture(scope="module")
def planner(whisper: Path) -> RequestPlanner:
    return RequestPlanner(whisper, max_model_len=4096)


def _states(rows: int = ROWS, width: int = WIDTH) -> layout_pb2.EncodedMedia:
    spec = tensor_pb2.TensorSpec(
        shape=[rows, width], dtype=tensor_pb2.D_TYPE_FLOAT32, nbytes=rows * width * 4,
        layout=tensor_pb2.TENSOR_LAYOUT_ROW_MAJOR,
    )  # fmt: skip
    handle = tensor_pb2.TensorHandle(
        transport=tensor_pb2.TRANSPORT_KIND_NIXL,
        agent=tensor_pb2.NixlAgentRef(agent_name="enc-a", instance_id="i1", producer_address="127.0.0.1:1"),
        lease_id="lease-w",
        tensors=[tensor_pb2.TensorDescriptor(name="embeddings", spec=spec)],
    )
    layout = layout_pb2.ItemLayout(
        modality=media_pb2.MODALITY_AUDIO, mm_hash="w" * 64, cross_attention_rows=rows,
        audio=layout_pb2.AudioLayout(feature_length=3000, output_length=rows, duration_s=2.0,
                                     window_frames=3000, clip_frames=3000),
    )  # fmt: skip
    return layout_pb2.EncodedMedia(layout=layout, embeddings=handle)


def _messages(*parts: chat_pb2.ContentPart) -> list[chat_pb2.ChatMessage]:
    return [chat_pb2.ChatMessage(role=chat_pb2.CHAT_ROLE_USER, parts=list(parts))]


def _refused(planner: RequestPlanner, messages: list[chat_pb2.ChatMessage], **sampling: object) -> EpdError:
    with pytest.raises(EpdError) as info:
        planner.plan("r", messages, eng.SamplingParams(**sampling))  # type: ignore[arg-type]
    return info.value


@pytest.mark.unit
def test_vllm_serves_whisper_in_e_pd_only_naming_why() -> None:
    assert refusal("vllm", "whisper", "e+pd") is None
    why = refusal("vllm", "whisper", "e/p/d")
    assert why is not None and why.startswith("--engine vllm with a whisper checkpoint is refused in the e/p/d layout")
    assert "no KV connector for encoder-decoder models" in why and "e+pd" in why
    assert refusal("reference", "whisper", "e/p/d") is None and refusal("vllm", "qwen2_5_omni", "e/p/d") is None


@pytest.mark.unit
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_vllm_prefill_and_decode_refuse_to_start_on_whisper(tmp_path: Path, role: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "whisper"}))
    module = importlib.import_module(f"libs.backends.vllm.{role}")
    with pytest.raises(SystemExit) as ended:
        asyncio.run(module.start(EngineSettings(model=tmp_path, engine="vllm")))
    assert str(ended.value.code).startswith("epd: --engine vllm with a whisper checkpoint is refused in the e/p/d")


@pytest.mark.unit
def test_the_plugin_is_an_installed_vllm_entry_point() -> None:
    """vLLM loads `vllm.general_plugins` in each of its processes (EngineCore resolves the model)."""
    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins.get("epd") == "libs.backends.vllm.plugin:register"


@pytest.mark.integration
def test_engine_arguments_name_the_projects_whisper_model(whisper: Path, tmp_path: Path) -> None:
    settings = EngineSettings(model=whisper, engine="vllm")
    args = runtime.engine_args(settings, failure_dir=tmp_path, ec_consumer=False)
    assert args["hf_overrides"] == {"architectures": [WHISPER_ARCHITECTURE]}
    assert args["enable_mm_embeds"] is True and args["logits_processors"] == [WHISPER_LOGITS]
    assert args["max_model_len"] == 448  # the decoder's positions (max_target_positions)
    assert "ec_transfer_config" not in args and "kv_transfer_config" not in args


@pytest.mark.integration
def test_a_window_becomes_generates_decoder_prompt_over_its_encoder_states(planner: RequestPlanner) -> None:
    tok = planner.tokenizer.convert_tokens_to_ids
    start, no_timestamps = tok("<|startoftranscript|>"), tok("<|notimestamps|>")
    messages = _messages(chat_pb2.ContentPart(encoded=_states()))
    planned = planner.plan("r", messages, eng.SamplingParams())
    assert planned.speech and planned.prompt == {"prompt_token_ids": [start, no_timestamps]}
    assert planned.uuids == ["w" * 64 + "-lease-w"] and planned.max_tokens == 448 - 2
    timed = planner.plan("r", messages, eng.SamplingParams(timestamps=True))
    assert timed.prompt == {"prompt_token_ids": [start]} and timed.max_tokens == 448 - 1
    states = torch.zeros(ROWS, WIDTH)
    request = with_encoder_states(planned, states)
    assert request["decoder_prompt"] is planned.prompt
    assert request["encoder_prompt"]["multi_modal_data"]["audio"][0] is states
    assert request["encoder_prompt"]["multi_modal_uuids"] == {"audio": planned.uuids}


@pytest.mark.integration
def test_what_whisper_cannot_take_is_refused_naming_the_field(planner: RequestPlanner) -> None:
    item = chat_pb2.ContentPart(encoded=_states())
    text = _refused(planner, _messages(item, chat_pb2.ContentPart(text="hello")))
    assert isinstance(text, InvalidArgument) and "messages[0].parts[1].text" in str(text)
    two = _refused(planner, _messages(item, item))
    assert isinstance(two, InvalidArgument) and "exactly one audio item, got 2" in str(two)
    rows = _refused(planner, _messages(chat_pb2.ContentPart(encoded=_states(rows=1000))))
    assert isinstance(rows, InvalidArgument)
    assert "parts[0].encoded.layout: layout has 1000 cross-attention rows" in str(rows)
    width = _refused(planner, _messages(chat_pb2.ContentPart(encoded=_states(width=512))))
    assert isinstance(width, InvalidArgument) and "[1500, 384]" in str(width)
    long = _refused(planner, _messages(item), max_tokens=447)
    assert isinstance(long, InvalidArgument) and "sampling.max_tokens" in str(long)
    assert planner.plan("r", _messages(item), eng.SamplingParams(max_tokens=446)).max_tokens == 446
