"""The peer-comparison harness of `make bench-vs-vllm`: vLLM's own deployments (its CLI, the proxy its
EPD example describes) beside EPD as `epd up` deploys it, driven by vLLM's own client. Measurement
code, not product: nothing under libs/ or services/ imports it."""
