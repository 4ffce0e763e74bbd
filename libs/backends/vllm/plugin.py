"""The project's vLLM plugin (a `vllm.general_plugins` entry point, pyproject.toml): vLLM loads it
in every one of its processes (the service's, EngineCore, a Worker, the model-inspection
subprocess), before it resolves a model or builds a worker or a connector there.

`register()`:
- refuses a vLLM other than the one the project's patches were checked against
  (`patches.VllmVersionMismatch`, naming both versions): the process fails at start-up;
- installs the project's patches to vLLM (patches.py lists each: what, why, vLLM version);
- registers the architectures only the project's checkpoints name (`whisper_model.py`), by
  module path: nothing is imported until an engine loads such a checkpoint.

Idempotent, as vLLM asks of a general plugin. A `vllm serve` from this environment gets the same
patches; each changes nothing unless it is needed (patches.py, `processes`): the polling window only
when `--engine-busy-poll-s` is set, the sampling wrapper only for the rows vLLM would crash on, the
video parser only for embedding inputs that carry `second_per_grid_ts`.
"""

from __future__ import annotations

from libs.backends.vllm import patches

WHISPER_ARCHITECTURE = "EpdWhisperForConditionalGeneration"
WHISPER_LOGITS = "libs.backends.vllm.whisper_model:WhisperLogits"  # generate()'s Whisper logits processors
WHISPER_TIMESTAMPS_ARG = "epd_whisper_timestamps"  # SamplingParams.extra_args key the processors read


def register(vllm_version: str | None = None) -> None:
    """vLLM's entry point (called without arguments); `vllm_version` replaces the installed vLLM's
    version in the check (tests)."""
    patches.install(vllm_version)

    from vllm import ModelRegistry

    if WHISPER_ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(WHISPER_ARCHITECTURE, f"libs.backends.vllm.whisper_model:{WHISPER_ARCHITECTURE}")
