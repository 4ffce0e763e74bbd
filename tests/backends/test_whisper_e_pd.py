"""Whisper tiny.en in the E+PD layout, the PD service on each engine (issue 25): a real stack
(router, the reference encoder, a PD service; each its own process) transcribes clips window by
window and streams exactly the tokens of WhisperForConditionalGeneration.generate() fed by
WhisperProcessor, greedy: two one-window utterances and a two-window long-form one (timestamps:
generate()'s logits rules), sent together; the same through the OpenAI door. On vLLM, the decoder
reads the encoder states the encoder made (over NIXL into the PD service's pool, then handed to
vLLM in the request: libs/backends/vllm/whisper_model.py) with the English-only decoder prompt
generate() uses, not vLLM's own transcription prompt (which gave empty transcripts)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from libs.client.transcribe import audio_item, transcription_request
from libs.contract.epd.v1 import (
    chat_pb2,
    prefill_decode_pb2,
    prefill_decode_pb2_grpc,
    service_info_pb2,
    service_info_pb2_grpc,
)
from libs.launch.stack import Stack, StackSpec
from libs.model.checkpoints.generate import ensure_converted
from libs.serving.speech import SPEECH_TRANSCRIPTION
from tests.support.openai_door import running_door
from tests.support.speech_corpus import UTTERANCES, utterance
from tests.support.stacks import run_requests, wait_pools_empty
from tests.support.vllm_unsplit import WHISPER_CLIPS
from tests.support.whisper_staged import load_reference, reference_tokens, transcribe_and_check

pytestmark = pytest.mark.slow

NAMES = ["short", "twenty_seconds", "long_form"]


@pytest.fixture(scope="module")
def whisper_path() -> Path:
    return ensure_converted()


@pytest.fixture(
    scope="module",
    params=[pytest.param("reference", marks=pytest.mark.stack), pytest.param("vllm", marks=pytest.mark.vllm)],
)
def whisper_e_pd(whisper_path: Path, tmp_path_factory: pytest.TempPathFactory, request: Any) -> Iterator[Stack]:
    engine = request.param
    spec = StackSpec(
        layout="e+pd",
        encoders=1,
        model=whisper_path,
        run_dir=tmp_path_factory.mktemp(f"whisper-{engine}"),
        engine=engine,
        ready_timeout_s=420.0,
    )
    with Stack(spec).running() as stack:
        yield stack


@pytest.mark.timeout(600)
def test_transcripts_equal_generate(whisper_path: Path, whisper_e_pd: Stack, vllm_unsplit: Any) -> None:
    """On vLLM, the one-window transcripts also equal vLLM's own unsplit run of the checkpoint (its
    feature extraction and tower, from generate()'s prompt: tests/support/vllm_unsplit.py)."""
    results = transcribe_and_check(whisper_e_pd.address, whisper_path, NAMES, "e-pd-")
    processor = load_reference(whisper_path)[1]
    if whisper_e_pd.spec.engine == "vllm":
        unsplit = vllm_unsplit(whisper_path, "whisper")
        assert {name: results[name].token_ids for name in WHISPER_CLIPS} == unsplit
    begin = processor.tokenizer.convert_tokens_to_ids("<|notimestamps|>") + 1
    assert any(t >= begin for t in results["long_form"].token_ids)  # two windows: timestamps
    assert not any(t >= begin for t in results["short"].token_ids)
    wait_pools_empty(whisper_e_pd)


def test_the_pd_service_advertises_transcription(whisper_e_pd: Stack) -> None:
    with grpc.insecure_channel(whisper_e_pd.processes["pd"].address) as channel:
        stub = service_info_pb2_grpc.ServiceInfoServiceStub(channel)
        info = stub.GetServiceInfo(service_info_pb2.GetServiceInfoRequest(), timeout=10).info
    assert SPEECH_TRANSCRIPTION in info.capabilities and f"engine.{whisper_e_pd.spec.engine}" in info.capabilities
    assert info.transcription.window_frames == 3000
    assert info.transcription.timestamp_begin_token_id > info.transcription.end_of_text_token_id


def test_a_request_whisper_cannot_take_is_refused_and_harms_nothing(whisper_path: Path, whisper_e_pd: Stack) -> None:
    """Text for Whisper's decoder, straight to the PD service: INVALID_ARGUMENT naming the field
    (vLLM never sees it: its planner checks as the reference runtime does); the next transcription
    is served as before."""
    request = prefill_decode_pb2.PrefillDecodeRequest(
        request_id="bad-text",
        messages=[chat_pb2.ChatMessage(role=chat_pb2.CHAT_ROLE_USER, parts=[chat_pb2.ContentPart(text="hello")])],
    )
    with grpc.insecure_channel(whisper_e_pd.processes["pd"].address) as channel:
        stub = prefill_decode_pb2_grpc.PrefillDecodeServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.PrefillDecode(request, timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "messages[0].parts[0].text" in (info.value.details() or "")
    clip = utterance(*UTTERANCES["short"])
    (after,) = run_requests(whisper_e_pd.address, [transcription_request(audio_item(clip))], timeout_s=240.0)
    model, processor = load_reference(whisper_path)
    assert after.token_ids == reference_tokens(model, processor, clip)
    wait_pools_empty(whisper_e_pd)


@pytest.mark.timeout(600)
def test_openai_transcriptions_equal_generate(whisper_path: Path, whisper_e_pd: Stack, tmp_path: Path) -> None:
    """`/v1/audio/transcriptions` through the OpenAI door, OpenAI's own client: generate()'s text
    (on vLLM too, where vLLM's own server of this checkpoint answered empty text, issue 25)."""
    import openai

    model, processor = load_reference(whisper_path)
    with running_door(whisper_e_pd.address, whisper_path, tmp_path) as address:
        client = openai.OpenAI(base_url=f"http://{address}/v1", api_key="unused", max_retries=0, timeout=300)
        for name in ("short", "twenty_seconds"):
            clip = utterance(*UTTERANCES[name])
            expected = processor.tokenizer.decode(reference_tokens(model, processor, clip), skip_special_tokens=True)
            got = client.audio.transcriptions.create(model=whisper_path.name, file=(f"{name}.wav", clip, "audio/wav"))
            assert got.text == expected.strip(), name
