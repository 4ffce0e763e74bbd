"""Seeded sampling of chunked prompts on vLLM's CPU workers.

vLLM's model runner samples a token for every request in a step, also for a prompt that is only
partly prefilled (a chunk), and drops it. A request with its own generator (a seed) must not have
advanced that generator, so vLLM rewinds it: `gen.set_offset(gen.get_offset() - 4)`, the Philox
offset of a CUDA generator. A CPU generator has no offset: the call raises, the worker dies and
every request in the engine fails (vLLM 0.32, `GPUModelRunner._bookkeeping_sync`). Any seeded,
non-greedy request whose prompt is chunked triggers it; on a P/D split every sampled request is
seeded (`runtime.split_seed`: decode must draw prefill's first token again).

`install()` (one of the project's vLLM patches, patches.py: the plugin installs it in each of vLLM's
processes, the Worker among them) leaves those generators out of the step instead: the dropped
token is drawn from the global generator, the request's own is not touched, so its tokens are the
ones an unchunked prefill draws, as vLLM's rewind means on CUDA.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

MARK = "_epd_holds_chunked_seeds"  # carried by the project's wrapper (patches.py checks it)


def held_generators(runner: Any) -> dict[int, Any]:
    """Take the CPU generators of the requests whose sampled token this step drops (vLLM's
    `discard_request_mask`, set when the step's inputs were prepared) out of the batch."""
    batch = runner.input_batch
    dropped = np.nonzero(runner.discard_request_mask.np[: batch.num_reqs])[0]
    held = {}
    for index in (int(i) for i in dropped):
        generator = batch.generators.get(index)
        if generator is not None and generator.device.type == "cpu":
            held[index] = batch.generators.pop(index)
    return held


def install() -> None:
    """Wrap `GPUModelRunner.sample_tokens` (the CPU runner's too) once per process."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner.sample_tokens
    if getattr(original, MARK, False):
        return

    @functools.wraps(original)
    def sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
        # The batch's generators dict is the sampler's too (SamplingMetadata.generators).
        held = held_generators(self) if self.execute_model_state is not None else {}
        try:
            return original(self, *args, **kwargs)
        finally:
            self.input_batch.generators.update(held)

    setattr(sample_tokens, MARK, True)
    GPUModelRunner.sample_tokens = sample_tokens  # type: ignore[method-assign,assignment]
