"""The reference engine: runs a family (`libs.model`) on transformers modules on CPU: the encoder,
prefill and decode runners, the language model's runtime, KV export/import, sampling and stopping.

See docs/runtime.md. No protobuf or gRPC imports here; the services map these types onto epd.v1.
"""
