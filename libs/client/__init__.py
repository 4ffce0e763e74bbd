"""A Python client of the router's `GenerateService` (used by `epd generate`, `make run` and tests)."""

from libs.client.generate import GenerationResult, build_request, generate, media_from_file

__all__ = ["GenerationResult", "build_request", "generate", "media_from_file"]
