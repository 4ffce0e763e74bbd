"""Seeded requests prefilled in chunks on vLLM's CPU worker (libs/backends/vllm/seeded_sampling.py):
vLLM's rewind of a dropped token's draw cannot run on a CPU generator; the project's wrapper keeps
the generator out of that step, so the request draws what an unchunked prefill draws. vLLM's own
sampler and real generators here; the stack test is test_vllm_split's chunked seeded case."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from libs.backends.vllm import seeded_sampling

pytestmark = pytest.mark.vllm  # imports vLLM (no engine starts)
VOCAB = 64


def _generator(seed: int) -> torch.Generator:
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    return generator


def _runner(generators: dict[int, torch.Generator], dropped: list[bool]) -> Any:
    batch = SimpleNamespace(generators=generators, num_reqs=len(dropped))
    return SimpleNamespace(
        input_batch=batch, discard_request_mask=SimpleNamespace(np=np.array(dropped)), execute_model_state=object()
    )


def _draw(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> list[int]:
    from vllm.v1.sample.ops.topk_topp_sampler import random_sample

    return [int(t) for t in random_sample(probs.clone(), generators)]


def test_vllms_rewind_cannot_run_on_a_cpu_generator() -> None:
    # What vLLM's _bookkeeping_sync calls for a dropped token of a seeded request.
    with pytest.raises(RuntimeError, match="CPU Generator does not use offset"):
        _generator(7).get_offset()


def test_a_chunked_seeded_prompt_draws_what_an_unchunked_one_draws() -> None:
    probs = torch.softmax(torch.randn(2, VOCAB, generator=_generator(0)), dim=-1)
    unchunked = _draw(probs[:1], {0: _generator(7)})[0]
    # Two chunks: the first step drops row 0's token (its prompt is not done), the second keeps it.
    generators = {0: _generator(7), 1: _generator(9)}
    runner = _runner(generators, [True, False])
    held = seeded_sampling.held_generators(runner)
    assert list(held) == [0] and list(generators) == [1]
    _draw(probs, generators)
    assert torch.equal(generators[1].get_state(), _generator(9).get_state()) is False  # row 1 drew
    generators.update(held)
    assert torch.equal(generators[0].get_state(), _generator(7).get_state())  # row 0 did not
    assert _draw(probs, generators)[0] == unchunked


def test_only_dropped_rows_with_cpu_generators_are_held() -> None:
    generators = {0: _generator(1), 2: _generator(3)}
    runner = _runner(generators, [False, True, True, False])  # row 1 dropped but unseeded
    assert list(seeded_sampling.held_generators(runner)) == [2]
    assert list(generators) == [0]


def test_the_wrapper_restores_the_generators_after_the_step_even_when_it_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    seen: list[list[int]] = []

    def sample_tokens(self: Any, grammar_output: Any) -> Any:
        seen.append(sorted(self.input_batch.generators))
        raise RuntimeError("step failed")

    monkeypatch.setattr(GPUModelRunner, "sample_tokens", sample_tokens)
    seeded_sampling.install()
    seeded_sampling.install()  # once per process: not wrapped twice
    wrapped = GPUModelRunner.sample_tokens
    assert getattr(wrapped, "__wrapped__", None) is sample_tokens
    generators = {0: _generator(1), 1: _generator(2)}
    runner = _runner(generators, [True, False])
    with pytest.raises(RuntimeError, match="step failed"):
        wrapped(runner, None)
    assert seen == [[1]]  # the step ran without the dropped request's generator
    assert sorted(generators) == [0, 1]  # and it is back for the next step
    runner.execute_model_state = None  # nothing to sample: vLLM returns early, nothing is held
    with pytest.raises(RuntimeError):
        wrapped(runner, None)
    assert seen[-1] == [0, 1]
