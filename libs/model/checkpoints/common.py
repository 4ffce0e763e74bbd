"""What a family's checkpoint recipe provides, and helpers the recipes share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class FamilySpec:
    bpe_vocab: int
    special_tokens: list[str]
    chat_template: str
    eos: str
    pad: str
    build: Callable[[str, dict[str, int], int, int], tuple[dict[str, Any], torch.nn.Module]]
    hub_name: Callable[[str], str]
    extra_files: Callable[[str], dict[str, dict[str, Any]]]
    # Special tokens named in tokenizer_config.json's `model_specific_special_tokens` (attribute -> token).
    named_tokens: dict[str, str] = field(default_factory=dict)


def round_vocab(n: int) -> int:
    return (n + 63) // 64 * 64


def rename_prefix(name: str, table: tuple[tuple[str, str], ...]) -> str:
    """`name` with the first matching local prefix replaced by its hub prefix."""
    for local, hub in table:
        if name.startswith(local):
            return hub + name[len(local) :]
    raise KeyError(name)
