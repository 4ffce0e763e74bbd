"""The epd.v1 contract: generated messages (`libs.contract.epd.v1`), the contract version,
semantic validation of requests, and the typed errors every service maps to gRPC status codes."""
