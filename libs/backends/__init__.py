"""Engines behind the epd.v1 contract, one backend per role and engine: `reference` (the project's
transformers runtime in libs/runtime) and `vllm` (vLLM's AsyncLLM), sibling packages implementing
the protocols of `api`, chosen by name through `registry`; `engines` names them and the pairs each
refuses (torch-free); `hosting` makes a model service's gRPC parts from whichever backend it runs."""
