"""Decode service (D): KV cache read over NIXL -> streamed tokens."""
