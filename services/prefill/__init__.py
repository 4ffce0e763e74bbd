"""Prefill service (P): metadata-only request + embeddings read over NIXL -> KV cache + first token."""
