"""Encoder-output cache: a local LRU in front of a shared Mooncake Store (docs/cache.md)."""
