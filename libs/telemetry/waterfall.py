"""One trace as a waterfall: an HTML page (inline SVG) or a PNG image (Pillow)."""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path

from libs.telemetry.spans import SpanRecord

COLORS = {
    "queue": "#9e9e9e",
    "preprocess": "#ffb74d",
    "encode": "#e65100",
    "cache_load": "#8d6e63",
    "transfer": "#1e88e5",
    "prefill": "#43a047",
    "decode": "#8e24aa",
    None: "#cfd8dc",
}
ROW, LABEL, WIDTH = 22, 360, 900


@dataclass
class Row:
    span: SpanRecord
    depth: int


def rows(spans: list[SpanRecord]) -> list[Row]:
    """Spans depth-first (children by start time) under the earliest root."""
    ids = {s.span_id for s in spans}
    children: dict[str, list[SpanRecord]] = {}
    for span in spans:
        parent = span.parent_id if span.parent_id in ids else ""
        children.setdefault(parent, []).append(span)
    out: list[Row] = []

    def walk(parent: str, depth: int) -> None:
        for span in sorted(children.get(parent, []), key=lambda s: s.start_ns):
            out.append(Row(span, depth))
            walk(span.span_id, depth + 1)

    walk("", 0)
    return out


def _geometry(layout: list[Row]) -> tuple[int, float]:
    t0 = min(r.span.start_ns for r in layout)
    t1 = max(r.span.end_ns for r in layout)
    return t0, WIDTH / max(1, t1 - t0)


def _label(row: Row) -> str:
    return f"{'  ' * row.depth}{row.span.service}: {row.span.name}"


def render_html(spans: list[SpanRecord], path: Path) -> None:
    layout = rows(spans)
    t0, scale = _geometry(layout)
    height = ROW * (len(layout) + 2)
    bars = []
    for i, row in enumerate(layout):
        s = row.span
        x = LABEL + (s.start_ns - t0) * scale
        w = max(1.0, (s.end_ns - s.start_ns) * scale)
        y = ROW * (i + 1)
        color = COLORS.get(s.attributes.get("epd.stage"), COLORS[None])
        tip = html.escape(f"{s.service} {s.name} {s.duration_s * 1e3:.2f} ms {s.attributes}")
        bars.append(
            f'<text x="4" y="{y + 15}" font-size="12" font-family="monospace">{html.escape(_label(row))}</text>'
            f'<rect x="{x:.1f}" y="{y + 3}" width="{w:.1f}" height="{ROW - 6}" fill="{color}">'
            f"<title>{tip}</title></rect>"
            f'<text x="{x + w + 4:.1f}" y="{y + 15}" font-size="11" font-family="monospace">'
            f"{s.duration_s * 1e3:.2f} ms</text>"
        )
    legend = " ".join(
        f'<span style="background:{c};padding:0 6px;margin-right:6px">{k}</span>' for k, c in COLORS.items() if k
    )
    path.write_text(
        f"<!doctype html><meta charset=utf-8><title>trace {spans[0].trace_id}</title>"
        f"<h3 style='font-family:sans-serif'>trace {spans[0].trace_id}</h3>"
        f"<p style='font-family:sans-serif'>{legend}</p>"
        f'<svg width="{LABEL + WIDTH + 120}" height="{height}">{"".join(bars)}</svg>'
    )


def render_png(spans: list[SpanRecord], path: Path) -> None:
    from PIL import Image, ImageDraw

    layout = rows(spans)
    t0, scale = _geometry(layout)
    image = Image.new("RGB", (LABEL + WIDTH + 120, ROW * (len(layout) + 2)), "white")
    draw = ImageDraw.Draw(image)
    draw.text((4, 4), f"trace {spans[0].trace_id}  (colors: {', '.join(k for k in COLORS if k)})", fill="black")
    for i, row in enumerate(layout):
        s = row.span
        x = LABEL + (s.start_ns - t0) * scale
        w = max(1.0, (s.end_ns - s.start_ns) * scale)
        y = ROW * (i + 1)
        draw.text((4, y + 5), _label(row)[:58], fill="black")
        draw.rectangle((x, y + 3, x + w, y + ROW - 3), fill=COLORS.get(s.attributes.get("epd.stage"), COLORS[None]))
        draw.text((x + w + 4, y + 5), f"{s.duration_s * 1e3:.2f} ms", fill="black")
    image.save(path)


def render(spans: list[SpanRecord], path: Path) -> None:
    """HTML for .html, PNG otherwise."""
    (render_html if path.suffix.lower() in (".html", ".htm") else render_png)(spans, path)
