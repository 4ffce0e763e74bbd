"""Whisper tiny.en (trained weights) through a real E/P/D stack (router, encoder, prefill, decode,
each its own process, contract 1.4 on the wire): the router transcribes each clip window by window
(Encode -> Prefill -> Decode per 30 s window, the next window's start from the previous window's
timestamps) and streams exactly the tokens of WhisperForConditionalGeneration.generate() fed by
WhisperProcessor, greedy - for two short utterances and one long-form (two-window) one, sent
concurrently. The encoder cache and tracing serve Whisper as the other families: the same clip
sent twice is encoded once, and each transcription's trace has its encode, prefill and decode
phases and a row in `epd trace report`."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from libs.client.transcribe import audio_item, transcription_request
from libs.contract.epd.v1 import service_info_pb2, service_info_pb2_grpc
from libs.contract.version import CONTRACT_MAJOR, CONTRACT_MINOR
from libs.launch.process import ServiceProcess
from libs.launch.stack import Stack, StackSpec
from libs.model.checkpoints.generate import ensure_converted
from libs.serving.speech import SPEECH_TRANSCRIPTION
from tests.support.epd_cli import parse_table, run_epd
from tests.support.hf_reference import reference_audio
from tests.support.metrics import counter_total
from tests.support.openai_door import running_door
from tests.support.release_tree import release_checkout
from tests.support.speech_corpus import UTTERANCES, utterance
from tests.support.stacks import run_requests
from tests.support.whisper_staged import load_reference, reference_tokens, transcribe_and_check

pytestmark = [pytest.mark.stack, pytest.mark.slow]

NAMES = ["short", "twenty_seconds", "long_form"]
RELEASE_1_3 = "Contract 1.3: KvCache.paged"


@pytest.fixture(scope="module")
def whisper_path() -> Path:
    return ensure_converted()


@pytest.fixture(scope="module")
def whisper_stack(whisper_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    spec = StackSpec(layout="e/p/d", encoders=1, model=whisper_path, run_dir=tmp_path_factory.mktemp("whisper"))
    stack = Stack(spec)
    stack.up()
    try:
        yield stack
    finally:
        statuses = stack.down()
        assert all(code == 0 for code in statuses.values()), f"unclean exit: {statuses}"


@pytest.mark.timeout(600)
def test_router_transcripts_equal_generate(whisper_path: Path, whisper_stack: Stack) -> None:
    results = transcribe_and_check(whisper_stack.address, whisper_path, NAMES, "")
    processor = load_reference(whisper_path)[1]
    # The long-form clip's transcript went through two windows: it holds timestamp tokens.
    begin = processor.tokenizer.convert_tokens_to_ids("<|notimestamps|>") + 1
    assert any(t >= begin for t in results["long_form"].token_ids)
    assert not any(t >= begin for t in results["short"].token_ids)


def _info(address: str) -> service_info_pb2.ServiceInfo:
    with grpc.insecure_channel(address) as channel:
        stub = service_info_pb2_grpc.ServiceInfoServiceStub(channel)
        info: service_info_pb2.ServiceInfo = stub.GetServiceInfo(
            service_info_pb2.GetServiceInfoRequest(), timeout=10
        ).info
        return info


def test_speech_services_advertise_transcription(whisper_stack: Stack) -> None:
    for name in ("encoder-0", "prefill", "decode"):
        info = _info(whisper_stack.processes[name].address)
        assert SPEECH_TRANSCRIPTION in info.capabilities, name
        # Transcription arrived in 1.4; a service speaks the contract's current minor, at least that.
        assert (info.contract_version.major, info.contract_version.minor) == (CONTRACT_MAJOR, CONTRACT_MINOR)
        assert CONTRACT_MINOR >= 4
        if name == "prefill":
            assert info.transcription.window_frames == 3000
            assert info.transcription.timestamp_begin_token_id > info.transcription.end_of_text_token_id


@pytest.mark.timeout(300)
def test_epd_transcribe_prints_the_transcript(whisper_path: Path, whisper_stack: Stack, tmp_path: Path) -> None:
    """`epd transcribe FILE --address ROUTER`, like `epd generate`: the streamed text on stdout (the
    text of generate()'s tokens), a summary line on stderr, exit 0; a missing file exits 2."""
    clip = tmp_path / "short.wav"
    clip.write_bytes(utterance(*UTTERANCES["short"]))
    done = run_epd(["transcribe", str(clip), "--address", whisper_stack.address], cwd=tmp_path, timeout_s=240)
    assert done.returncode == 0, done.stderr
    model, processor = load_reference(whisper_path)
    expected = processor.tokenizer.decode(reference_tokens(model, processor, clip.read_bytes()))
    assert done.stdout.strip() == expected.strip()
    assert ", stop," in done.stderr  # the finish reason in words, as `epd generate` prints it
    missing = run_epd(["transcribe", str(tmp_path / "none.wav"), "--address", whisper_stack.address], tmp_path, 120)
    assert missing.returncode == 2 and "no such file" in missing.stderr


@pytest.mark.timeout(400)
def test_a_contract_1_3_router_passes_the_speech_fields(
    whisper_path: Path, whisper_stack: Stack, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Cross-version: a router of the commit that released contract 1.3 (before any speech field)
    in front of the 1.4 encoder, prefill and decode serves a one-window clip with generate()'s
    tokens: the cross-attention rows, window frames and cross-attention KV pass through it as
    fields it copies without reading. Being a plain Generate router, it also streams the window's
    end-of-text token (the 1.4 router drops it, as generate() does), and it cannot transcribe a
    clip over 30 s (that needs the 1.4 router's window loop)."""
    clip = utterance(*UTTERANCES["short"])
    model, processor = load_reference(whisper_path)
    expected = reference_tokens(model, processor, clip)
    end_of_text = processor.tokenizer.eos_token_id
    processes = whisper_stack.processes
    args = ["--encoders", processes["encoder-0"].address, "--prefill", processes["prefill"].address]
    args += ["--decode", processes["decode"].address]
    with release_checkout(RELEASE_1_3, tmp_path_factory.mktemp("v1_3")) as tree:
        log = tree.parent / "router-1.3.log"
        router = ServiceProcess("router-1.3", "services.router", args, log_path=log, root=tree)
        router.start()
        try:
            router.wait_ready(120)
            assert _info(router.address).contract_version.minor == 3  # really the 1.3 release's router
            (result,) = run_requests(router.address, [transcription_request(audio_item(clip), request_id="old")])
        finally:
            assert router.stop() == 0, router.log_tail()
    assert result.token_ids == [*expected, end_of_text]


@pytest.mark.timeout(500)
def test_make_run_speech_demo(whisper_path: Path, tmp_path: Path) -> None:
    """`make run` ends with `epd speech-demo`: its own Whisper stack, both synthesized clips
    transcribed (the long one through two windows), a clean stop and the trace report's rows."""
    import subprocess

    from libs.launch.process import ROOT

    dry = subprocess.run(["make", "-n", "--no-print-directory", "run"], cwd=ROOT, capture_output=True, text=True)
    assert any(line.split()[1:2] == ["speech-demo"] for line in dry.stdout.splitlines() if line.strip()), dry.stdout
    spans = tmp_path / "spans.jsonl"
    args = ["speech-demo", "--model", str(whisper_path), "--run-dir", str(tmp_path / "run"), "--trace-file", str(spans)]
    done = run_epd(args, cwd=tmp_path, timeout_s=420)
    assert done.returncode == 0, done.stdout + done.stderr
    _, rows = parse_table(done.stdout, "clip ")
    assert set(rows) >= {"short", "long-form"}
    assert all(rows[name][0] != "FAILED" and int(rows[name][1]) > 0 for name in ("short", "long-form")), rows
    assert "stopped: {'router': 0, 'encoder-0': 0, 'prefill': 0, 'decode': 0}" in done.stdout
    _, report = parse_table(done.stdout, "request ")
    assert {"speech-short", "speech-long-form"} <= set(report)
    windows = [line for line in spans.read_text().splitlines() if '"epd.transcribe.window"' in line]
    assert len(windows) == 3  # one window for the short clip, two for the long one


@pytest.mark.timeout(400)
def test_same_clip_twice_is_a_cache_hit_and_traced(whisper_path: Path, tmp_path: Path) -> None:
    """The same clip transcribed twice, one after the other, by a traced stack: both get generate()'s
    tokens; the first encode computes the window (an `encoder.compute` span, one compute on the
    encoder's counter), the second is a hit in the encoder's cache (no compute span, no second
    compute, one more lookup); each trace holds the router's `epd.encode`, `epd.prefill` and
    `epd.decode` phases inside one `epd.transcribe.window`, and `epd trace report` on the span file
    prints a row per transcription with its tokens and a nonzero encode time for the first only."""
    import urllib.request

    from libs.launch.process import free_port
    from libs.telemetry.report import breakdowns
    from libs.telemetry.spans import by_trace, load_jsonl

    spans_file = tmp_path / "spans.jsonl"
    port = free_port()
    spec = StackSpec(
        layout="e/p/d",
        encoders=1,
        model=whisper_path,
        run_dir=tmp_path / "run",
        env={"EPD_TRACE_EXPORTER": "jsonl", "EPD_TRACE_FILE": str(spans_file)},
        extra_args={"encoder-0": ["--metrics-port", str(port)]},
    )
    clip = utterance(*UTTERANCES["medium"])
    with Stack(spec).running() as stack:
        results = [
            run_requests(stack.address, [transcription_request(audio_item(clip), request_id=f"again-{i}")])[0]
            for i in range(2)
        ]
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    model, processor = load_reference(whisper_path)
    expected = reference_tokens(model, processor, clip)
    assert [r.token_ids for r in results] == [expected, expected]
    assert counter_total(metrics, "epd_cache_computes_total") == 1
    assert counter_total(metrics, "epd_cache_lookups_total") == 2

    recorded = load_jsonl(spans_file)
    rows = {b.request_id: b for b in breakdowns(recorded)}
    assert set(rows) == {"again-0", "again-1"}
    traces = by_trace(recorded)
    for request_id, computes in (("again-0", 1), ("again-1", 0)):
        names = [s.name for s in traces[rows[request_id].trace_id]]
        assert names.count("epd.transcribe.window") == 1, request_id
        assert all(names.count(phase) == 1 for phase in ("epd.encode", "epd.prefill", "epd.decode")), names
        assert names.count("encoder.compute") == computes, request_id
        assert rows[request_id].output_tokens == len(expected)
    assert rows["again-0"].parts["encode"] > 0 and rows["again-1"].parts["encode"] == 0

    done = run_epd(["trace", "report", "--file", str(spans_file)], cwd=tmp_path, timeout_s=120)
    assert done.returncode == 0, done.stderr
    columns, report = parse_table(done.stdout, "request ")
    assert {"again-0", "again-1"} <= set(report)
    tokens, encode = columns.index("tokens"), columns.index("encode")
    assert all(int(report[r][tokens]) == len(expected) for r in ("again-0", "again-1")), report
    assert float(report["again-0"][encode]) > 0 and float(report["again-1"][encode]) == 0, done.stdout


@pytest.fixture(scope="module")
def door_url(whisper_path: Path, whisper_stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The OpenAI door in front of the Whisper stack's router."""
    with running_door(whisper_stack.address, whisper_path, tmp_path_factory.mktemp("whisper-door")) as address:
        yield f"http://{address}/v1"


@pytest.mark.timeout(600)
def test_openai_transcriptions_equal_generate(whisper_path: Path, door_url: str) -> None:
    """OpenAI's own client, unchanged: `json` and `text` give generate()'s transcript; `verbose_json`
    of the long-form clip gives ordered segments inside the clip whose texts make the transcript."""
    import openai

    client = openai.OpenAI(base_url=door_url, api_key="unused", max_retries=0, timeout=480)
    model, processor = load_reference(whisper_path)
    short = utterance(*UTTERANCES["short"])
    expected = processor.tokenizer.decode(reference_tokens(model, processor, short), skip_special_tokens=True).strip()
    as_json = client.audio.transcriptions.create(model=whisper_path.name, file=("short.wav", short, "audio/wav"))
    assert as_json.text == expected
    as_text = client.audio.transcriptions.create(
        model=whisper_path.name, file=("short.wav", short, "audio/wav"), response_format="text"
    )
    assert str(as_text).strip() == expected
    # Within one window, the segments are generate(return_timestamps=True)'s, as its tokenizer offsets them.
    twenty = utterance(*UTTERANCES["twenty_seconds"])
    audio = reference_audio(twenty, "wav", 16000)
    features = processor(audio, sampling_rate=16000, return_tensors="pt").input_features
    with torch.inference_mode():
        timed = model.generate(features, return_timestamps=True)[0].tolist()
    offsets = processor.tokenizer.decode(timed, output_offsets=True, skip_special_tokens=True)["offsets"]
    one_window = client.audio.transcriptions.create(
        model=whisper_path.name, file=("twenty.wav", twenty, "audio/wav"), response_format="verbose_json"
    )
    got = [(s.start, s.end, s.text.strip()) for s in one_window.segments or []]
    assert got == [(round(o["timestamp"][0], 2), round(o["timestamp"][1], 2), o["text"].strip()) for o in offsets]
    long_form = utterance(*UTTERANCES["long_form"])
    verbose = client.audio.transcriptions.create(
        model=whisper_path.name, file=("long.wav", long_form, "audio/wav"), response_format="verbose_json"
    )
    segments = verbose.segments or []
    assert len(segments) >= 2
    assert all(s.start <= s.end for s in segments)
    assert all(a.end <= b.start + 1e-6 for a, b in itertools.pairwise(segments))
    assert segments[-1].end <= verbose.duration + 0.5 and verbose.duration > 30
    assert "".join(s.text for s in segments).strip() == verbose.text
    with pytest.raises(openai.BadRequestError) as caught:
        client.audio.transcriptions.create(
            model=whisper_path.name, file=("short.wav", short, "audio/wav"), language="de"
        )
    assert caught.value.body["param"] == "language"  # type: ignore[index]
