"""The `epd` command: `epd up` (a stack on loopback), `epd generate` (a client), `epd demo` (make run)."""
