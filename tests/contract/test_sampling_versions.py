"""Contract 1.6's sampling fields across minors: a 1.5 peer (the v1.5 snapshot's generated code)
parses a 1.6 request with every known field intact and the new ones as unknown fields it would
ignore - which is why the router sends them only to stages advertising `sampling.openai`, and a
1.5 stage's ServiceInfo (its golden vector) does not; a 1.6 stream chunk with log-probabilities
reads to a 1.5 caller as the same tokens and text; a 1.5 request means the same to 1.6 code
(every 1.6 field at its default: penalties off, no logprobs)."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import text_format

from libs.contract import validation
from libs.contract.epd.v1 import generate_pb2, generation_pb2, sampling_pb2, service_info_pb2
from libs.contract.errors import InvalidArgument
from libs.contract.snapshots.v1_5.epd.v1 import generate_pb2 as generate_v1_5
from libs.contract.snapshots.v1_5.epd.v1 import generation_pb2 as generation_v1_5
from libs.model.types import SamplingParams
from libs.serving.convert import sampling_to_engine
from services.router.stubs import StageStubs
from tests.support.router_checks import PassingChecks

pytestmark = pytest.mark.unit

WIRE_1_5 = Path(__file__).resolve().parents[2] / "proto" / "snapshots" / "v1.5" / "wire"


def _request_1_6() -> generate_pb2.GenerateRequest:
    sampling = sampling_pb2.SamplingParams(
        temperature=0.0,
        max_tokens=16,
        stop=["END"],
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repetition_penalty=1.2,
        min_tokens=3,
        ignore_eos=True,
        logprobs=2,
    )
    return generate_pb2.GenerateRequest(request_id="r-16", sampling=sampling)


def test_a_1_5_peer_keeps_the_known_fields_and_sees_the_new_ones_as_unknown() -> None:
    old = generate_v1_5.GenerateRequest.FromString(_request_1_6().SerializeToString())
    assert old.sampling.max_tokens == 16 and list(old.sampling.stop) == ["END"]
    shown = text_format.MessageToString(old.sampling, print_unknown_fields=True)
    unknown = {line.split(":")[0] for line in shown.splitlines() if line[:1].isdigit()}
    assert unknown == {"9", "10", "11", "12", "13", "14"}  # numbers only: a 1.5 engine ignores them
    # Forwarded by a 1.5 proxy, they survive to a 1.6 stage.
    assert generate_pb2.GenerateRequest.FromString(old.SerializeToString()) == _request_1_6()


def test_a_1_5_stage_does_not_advertise_the_fields_so_the_router_refuses_them() -> None:
    info_1_5 = service_info_pb2.GetServiceInfoResponse.FromString(
        (WIRE_1_5 / "epd.v1.GetServiceInfoResponse.binpb").read_bytes()
    ).info
    assert validation.SAMPLING_CAPABILITY not in info_1_5.capabilities
    checks = PassingChecks()
    infos = {"old:1": info_1_5, "new:1": service_info_pb2.ServiceInfo(capabilities=[validation.SAMPLING_CAPABILITY])}
    checks.honoring = lambda address, capability: capability in infos[address].capabilities
    backends = StageStubs(encoder=lambda a: None, lease=lambda a: None, checks=checks, prefill_decode=lambda a: None)
    request = _request_1_6()
    backends.check_sampling("new:1", "decode", request.sampling)
    with pytest.raises(InvalidArgument) as caught:
        backends.check_sampling("old:1", "decode", request.sampling)
    assert caught.value.field == "sampling.presence_penalty"
    # A request without 1.6 fields goes to either.
    backends.check_sampling("old:1", "decode", sampling_pb2.SamplingParams(max_tokens=16))


def test_a_1_6_chunk_with_logprobs_reads_to_a_1_5_caller_as_the_same_tokens() -> None:
    entry = generation_pb2.TokenLogprobs(
        chosen=generation_pb2.TokenLogprob(token_id=5, logprob=-0.5, token=" a"),
        top=[generation_pb2.TokenLogprob(token_id=5, logprob=-0.5, token=" a")],
    )
    chunk = generation_pb2.TokenChunk(token_ids=[5], text=" a", logprobs=[entry])
    old = generation_v1_5.TokenChunk.FromString(chunk.SerializeToString())
    assert list(old.token_ids) == [5] and old.text == " a"


def test_a_1_5_request_means_the_same_to_1_6_code() -> None:
    old = generate_pb2.GenerateRequest.FromString((WIRE_1_5 / "epd.v1.GenerateRequest.binpb").read_bytes())
    assert validation.uses_since_1_6(old.sampling) is None
    engine = sampling_to_engine(old.sampling)
    defaults = SamplingParams()
    assert (engine.presence_penalty, engine.frequency_penalty, engine.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (engine.min_tokens, engine.ignore_eos, engine.logprobs) == (
        defaults.min_tokens,
        defaults.ignore_eos,
        defaults.logprobs,
    )
