"""Results on disk: JSON (strict: infinities and NaN become null) and matplotlib PNG plots."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(data), indent=1, sort_keys=True, allow_nan=False) + "\n")


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def line_plot(
    path: Path,
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    hline: tuple[float, str] | None = None,
) -> None:
    """One line per series name: (x values, y values)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    for name, (xs, ys) in series.items():
        ax.plot(list(xs), list(ys), marker="o", label=name)
    if hline is not None:
        ax.axhline(hline[0], color="grey", linestyle="--", linewidth=1, label=hline[1])
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def bar_plot(
    path: Path,
    groups: Mapping[str, Mapping[str, float]],
    *,
    title: str,
    ylabel: str,
    stacked: bool = False,
) -> None:
    """Bars per group (x) and series (colour); `stacked` stacks the series of a group."""
    plt = _pyplot()
    names = list(groups)
    series = list(dict.fromkeys(s for g in groups.values() for s in g))  # first-seen order
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    width = 0.8 if stacked else 0.8 / max(1, len(series))
    bottoms = [0.0] * len(names)
    for i, s in enumerate(series):
        values = [groups[n].get(s, 0.0) for n in names]
        xs = [j + (0 if stacked else (i - (len(series) - 1) / 2) * width) for j in range(len(names))]
        ax.bar(xs, values, width=width, bottom=bottoms if stacked else None, label=s)
        if stacked:
            bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    ax.set_xticks(range(len(names)), names)
    ax.set(title=title, ylabel=ylabel)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
