"""What the backends stand on (below libs/backends, above libs/rpc): conversions between epd.v1
messages and runtime types, runtime errors as typed contract errors, the compute thread and batched
decode loop, the tensor transport bound to gRPC, prefill / decode / encode helpers of the reference
runtime, media sources, the settings every model service shares and the `ServiceInfo` it builds.
The runtime never sees protobuf; the services never hand-convert fields. The scaffolding a service
builds around its backend (leases, stats, drain) is libs/backends/hosting."""
