"""A decoder-only language model: a transformers text model plus its output head."""

from __future__ import annotations

import torch


class CausalLM(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, hidden_size: int, vocab_size: int) -> None:
        super().__init__()
        self.model = model
        self.lm_head = torch.nn.Linear(hidden_size, vocab_size, bias=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        embed_tokens: torch.nn.Module = self.model.embed_tokens  # type: ignore[assignment]
        out: torch.Tensor = embed_tokens(input_ids)
        return out


def strip_prefixes(name: str, prefixes: tuple[str, ...]) -> str | None:
    """`name` without the first matching prefix, or None if none matches."""
    for prefix in prefixes:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return None
