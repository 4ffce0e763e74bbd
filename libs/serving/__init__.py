"""What the backends stand on (below libs/backends, above libs/rpc): conversions between epd.v1
messages and the model's types (`convert`), engine errors as typed contract errors, the compute
thread and batched decode loop, the tensor transport bound to gRPC (`transport`, `embeddings`),
prefill / decode / encode helpers of the reference runtime, media sources, the settings every model
service shares and who it is (`service_info`). The engines never see protobuf; the services never
hand-convert fields. What a service builds around its backend (leases, stats, drain) is
libs/backends/hosting, above the backends."""
