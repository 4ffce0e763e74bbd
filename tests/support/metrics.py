"""Reading a service's Prometheus text exposition."""

from __future__ import annotations

import re


def counter_total(text: str, name: str) -> float:
    """Sum of a Prometheus counter's samples (all label sets)."""
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.MULTILINE))
