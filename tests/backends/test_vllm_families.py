"""The families beyond Omni on vLLM, in `make test`: Qwen2.5-VL through E/P/D on vLLM with the
reference encoder, Qwen3-VL (deepstack) through E/P/D on vLLM with the vLLM encoder. One stack per
family and layout, shared by its cases, its language-model engines compiled as deployed (the
suite's other stacks run eager). Every mix (text, image, two images, video, video sampled at
4 fps) gives the reference runtime's tokens; the mixes whose preprocessing vLLM shares with the
project also give vLLM's own unsplit run's tokens (tests/support/vllm_unsplit.py). Omni: E+PD in
test_vllm_pd.py, E/P/D in test_vllm_split.py; Qwen2.5-VL E+PD with the vLLM encoder in
test_vllm_encoder.py. The whole matrix, by hand: tests/benchmarks/vllm_tokens.py."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from libs.launch.stack import Stack, StackSpec
from libs.model.checkpoints import ensure_checkpoint
from tests.support import vllm_stack
from tests.support.vllm_stack import CHUNKED_PREFILL_TOKENS, Mix, call, mixes, reference_tokens, run, stats
from tests.support.vllm_unsplit import AGREEING_MIXES

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@dataclass(frozen=True)
class Case:
    family: str
    layout: str
    encoder_engine: str

    def __str__(self) -> str:
        return f"{self.family}-{self.layout}-{self.encoder_engine}"


CASES = [Case("qwen2_5_vl", "e/p/d", "reference"), Case("qwen3_vl", "e/p/d", "vllm")]
MIX_NAMES = [mix.name for mix in mixes("qwen2_5_vl")]
assert [mix.name for mix in mixes("qwen3_vl")] == MIX_NAMES


@dataclass
class Running:
    case: Case
    model: Path
    stack: Stack
    mixes: dict[str, Mix]
    tokens: dict[str, list[int]] = field(default_factory=dict)  # per mix: one call, two comparisons


@pytest.fixture(scope="module", params=CASES, ids=str)
def running(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    case: Case = request.param
    model = ensure_checkpoint(case.family, "tiny")
    spec = StackSpec(
        layout=case.layout,
        encoders=1,
        model=model,
        run_dir=tmp_path_factory.mktemp(f"vllm-{case}".replace("/", "-")),
        engine="vllm",
        encoder_engine=case.encoder_engine,
        ready_timeout_s=600.0,
        # Every multimodal prompt prefilled in chunks, as in the Omni stacks.
        extra_args={"prefill": ["--max-num-batched-tokens", str(CHUNKED_PREFILL_TOKENS)]},
        # The engines as deployed: vLLM compiles the language model (the suite's other stacks run eager).
        env={"EPD_ENFORCE_EAGER": "false"},
    )
    with Stack(spec).running() as stack:
        yield Running(case, model, stack, {mix.name: mix for mix in mixes(case.family)})


def _tokens(running: Running, mix: str) -> list[int]:
    if mix not in running.tokens:
        result = call(running.stack.address, vllm_stack.request(running.mixes[mix]))
        assert result.completion_tokens == len(result.token_ids)
        running.tokens[mix] = result.token_ids
    return running.tokens[mix]


@pytest.mark.parametrize("mix", MIX_NAMES)
def test_tokens_equal_the_reference_runtime(running: Running, mix: str) -> None:
    assert _tokens(running, mix) == reference_tokens(running.model, running.mixes[mix])


@pytest.mark.parametrize("mix", sorted(AGREEING_MIXES & set(MIX_NAMES)))
def test_tokens_equal_vllms_own_unsplit_run(
    running: Running, vllm_unsplit: Callable[[Path, str], dict[str, list[int] | str]], mix: str
) -> None:
    assert _tokens(running, mix) == vllm_unsplit(running.model, running.case.family)[mix]


def test_every_lease_and_sequence_is_released(running: Running) -> None:
    """After the cases above: no slot or lease held by the encoder, no KV handoff held by
    prefill's engine, no sequence left (acks are asynchronous: polled on the services' stats)."""
    addresses = {name: process.address for name, process in running.stack.processes.items()}
    deadline = time.monotonic() + 40
    while True:
        encoder = run(stats, addresses["encoder-0"])
        prefill, decode = run(stats, addresses["prefill"]), run(stats, addresses["decode"])
        busy = {
            "encoder": encoder.pool.slots_in_use + encoder.pool.active_leases,
            "prefill KV leases": prefill.pool.active_leases,
            "sequences": prefill.active_sequences + decode.active_sequences,
        }
        if not any(busy.values()):
            return
        assert time.monotonic() < deadline, f"still held: {busy}"
        time.sleep(0.25)
