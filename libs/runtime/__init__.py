"""Model runtime (engine) for E/P/D: family adapters, EncoderRunner, PrefillRunner, DecodeRunner.

See docs/runtime.md. No protobuf or gRPC imports here; the services map these types onto epd.v1.
"""
