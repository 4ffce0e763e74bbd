"""EPD services. Each is a thin gRPC adapter over a core testable without a socket; no service
imports another (enforced by import-linter, see pyproject.toml)."""
