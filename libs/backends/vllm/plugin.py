"""The project's vLLM plugin (a `vllm.general_plugins` entry point, pyproject.toml): vLLM loads it
in every one of its processes (the service's, EngineCore, a Worker), before it resolves a model.

It registers the architectures only the project's checkpoints name (`whisper_model.py`), by
module path: nothing is imported until an engine loads such a checkpoint, so a `vllm serve` of
any other model in this environment is unchanged.
"""

from __future__ import annotations

WHISPER_ARCHITECTURE = "EpdWhisperForConditionalGeneration"
WHISPER_LOGITS = "libs.backends.vllm.whisper_model:WhisperLogits"  # generate()'s Whisper logits processors
WHISPER_TIMESTAMPS_ARG = "epd_whisper_timestamps"  # SamplingParams.extra_args key the processors read


def register() -> None:
    from vllm import ModelRegistry

    if WHISPER_ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(WHISPER_ARCHITECTURE, f"libs.backends.vllm.whisper_model:{WHISPER_ARCHITECTURE}")
