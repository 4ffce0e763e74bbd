"""Engines behind the epd.v1 contract, one backend per role and engine: `reference` (the project's
transformers runtime in libs/runtime) and `vllm` (vLLM's AsyncLLM), sibling packages implementing
the protocols of `api`, chosen by name through `registry`."""
