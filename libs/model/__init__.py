"""What a model family is, apart from any engine that runs it: the shared request and layout types
(`types`, torch-free), typed failures (`errors`), each family's adapter (`families`: which tensors
are whose, preprocessing, placeholders, positions), prompt rules (`prompt`), media decoding and
limits (`media`), content identity (`content`), checkpoint reading (`checkpoint`) and the tooling
that makes the project's checkpoints (`checkpoints`).

The reference engine (`libs.runtime`), the vLLM backend, the encoder cache and the router all
read it; it imports nothing else of the project. See docs/runtime.md.
"""
