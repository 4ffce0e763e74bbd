"""Deterministic tiny/small random-weight checkpoints, generated locally (nothing is downloaded)."""

from libs.model.checkpoints.generate import FAMILIES, SIZES, ensure_checkpoint, generate_checkpoint

__all__ = ["FAMILIES", "SIZES", "ensure_checkpoint", "generate_checkpoint"]
