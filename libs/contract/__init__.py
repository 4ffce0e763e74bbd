"""The epd.v1 contract: generated messages (`libs.contract.epd.v1`), the contract version,
semantic validation of requests, the typed errors every service maps to gRPC status codes, and the
failure reasons those statuses carry (`libs.contract.reasons`, contract 1.5)."""
