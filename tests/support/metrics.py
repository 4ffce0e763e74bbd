"""Reading a service's Prometheus text exposition."""

from __future__ import annotations

import re
import urllib.request


def scrape(port: int) -> str:
    """A service's Prometheus /metrics (`--metrics-port`)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return str(reply.read().decode())


def counter_total(text: str, name: str) -> float:
    """Sum of a Prometheus counter's samples (all label sets)."""
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.MULTILINE))


def sample_values(metrics: str, name: str, label: str = "") -> list[float]:
    """The values of metric `name`'s samples (those whose labels contain `label`)."""
    return [
        float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(name + "{") and label in line
    ]
