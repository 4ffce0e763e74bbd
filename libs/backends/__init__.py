"""Engines behind the epd.v1 contract, one package each: `reference` (the project's transformers
runtime in libs/runtime) and `vllm` (vLLM's AsyncLLM). `api` is what a service sees of either."""
