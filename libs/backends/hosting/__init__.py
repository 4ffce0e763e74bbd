"""Hosting a backend as a gRPC service: what every model service registers besides its own
servicer (leases, stats), its `ServiceInfo`, drain and clean-up, built from the backend it was
given (`libs.backends.api`, never an engine package directly). The services build on it."""
