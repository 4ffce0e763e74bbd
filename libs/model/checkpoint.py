"""A checkpoint directory: config, safetensors shards, and selective tensor loading.

Only the tensors a predicate accepts are read from disk, so an encoder process never holds
language-model weights and vice versa. Every name read is recorded in `loaded_names`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from libs.model.errors import CheckpointError


class Checkpoint:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        config_file = self.path / "config.json"
        if not config_file.is_file():
            raise CheckpointError(f"no config.json in {self.path}", field="model_path")
        self.config: dict[str, Any] = json.loads(config_file.read_text())
        self.shards = self._find_shards()
        self.loaded_names: set[str] = set()

    def _find_shards(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            return [self.path / name for name in sorted(set(weight_map.values()))]
        shards = sorted(self.path.glob("*.safetensors"))
        if not shards:
            raise CheckpointError(f"no safetensors files in {self.path}", field="model_path")
        return shards

    def tensor_names(self) -> list[str]:
        names: list[str] = []
        for shard in self.shards:
            with safe_open(str(shard), framework="pt") as f:
                names.extend(f.keys())
        return names

    def load(self, select: Callable[[str], str | None]) -> dict[str, torch.Tensor]:
        """Read the tensors `select` maps to a module-local name (None skips the tensor)."""
        out: dict[str, torch.Tensor] = {}
        for shard in self.shards:
            with safe_open(str(shard), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    local = select(name)
                    if local is None:
                        continue
                    out[local] = f.get_tensor(name)
                    self.loaded_names.add(name)
        return out

    def json_file(self, name: str) -> dict[str, Any]:
        file = self.path / name
        return json.loads(file.read_text()) if file.is_file() else {}

    def weights_digest(self) -> str:
        """SHA-256 over the weight files' names and contents (identical for every role)."""
        digest = hashlib.sha256()
        for shard in self.shards:
            digest.update(shard.name.encode())
            with shard.open("rb") as f:
                while block := f.read(1 << 22):
                    digest.update(block)
        return digest.hexdigest()


def load_into(module: torch.nn.Module, tensors: dict[str, torch.Tensor], what: str) -> None:
    """Load tensors into a module; any missing or unexpected key is a checkpoint error."""
    result = module.load_state_dict(tensors, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise CheckpointError(
            f"{what}: missing {sorted(result.missing_keys)[:5]}, unexpected {sorted(result.unexpected_keys)[:5]}",
            field="model_path",
        )
