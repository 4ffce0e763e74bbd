"""Whitespace-aligned tables for the commands' output (the first column left-aligned, the rest
right-aligned, as `kubectl get` and `docker ps` print): easy to read and to split on whitespace."""

from __future__ import annotations

from collections.abc import Sequence


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(c) for c in header], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = []
    for row in cells:
        first = row[0].ljust(widths[0])
        lines.append("  ".join([first, *(c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True))]).rstrip())
    return "\n".join(lines) + "\n"
