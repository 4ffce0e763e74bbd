"""`epd plan` as a user runs it, on a span file written the way the services write theirs: tables
(the measured profile, the prediction), never Python reprs; instance counts that do not fit the
layout are refused naming the flag, the layout and what it takes."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from libs.cli.main import main
from tests.support.epd_cli import parse_table

pytestmark = pytest.mark.unit

T0 = 1_700_000_000.0  # seconds since the epoch: spans carry wall-clock times


def _span(
    trace: int, span: int, parent: int, name: str, service: str, start: float, end: float, **attrs: object
) -> str:
    def iso(t: float) -> str:
        return datetime.fromtimestamp(T0 + t, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")

    return json.dumps(
        {
            "name": name,
            "context": {"trace_id": f"0x{trace:032x}", "span_id": f"0x{span:016x}"},
            "parent_id": f"0x{parent:016x}" if parent else None,
            "start_time": iso(start),
            "end_time": iso(end),
            "attributes": attrs,
            "resource": {"attributes": {"service.name": service}},
        }
    )


def _measured_run(path: Path) -> None:
    """E+PD requests, text and image: a router root with its TTFT, an encode for images, a prefill."""
    lines = []
    for i in range(8):
        trace, start = i + 1, i * 1.0
        image = i % 2 == 1
        root = 100 * trace
        ttft = 0.3 if image else 0.06
        attrs = {"epd.ttft_s": ttft, "epd.request_id": f"r{i}", "gen_ai.usage.output_tokens": 8}
        lines.append(_span(trace, root, 0, "GenerateService/Generate", "router", start, start + 0.5, **attrs))
        at = start
        if image:
            call, server = root + 1, root + 2
            lines.append(
                _span(
                    trace, call, root, "epd.encode.item", "router", at, at + 0.2, **{"epd.modality": "MODALITY_IMAGE"}
                )
            )
            lines.append(_span(trace, server, call, "EncoderService/Encode", "encoder", at, at + 0.2))
            lines.append(
                _span(trace, root + 3, server, "encoder.compute", "encoder", at, at + 0.2, **{"epd.stage": "encode"})
            )
            at += 0.2
        prefill_s = 0.08 if image else 0.05
        attrs = {"epd.stage": "prefill", "epd.prompt_tokens": 300 if image else 20}
        lines.append(_span(trace, root + 4, root, "prefill.compute", "pd", at, at + prefill_s, **attrs))
    path.write_text("\n".join(lines) + "\n")


def _epd(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as done:
        main(args)
    out, err = capsys.readouterr()
    return int(done.value.code or 0), out, err


def test_predictions_print_as_tables(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spans = tmp_path / "spans.jsonl"
    _measured_run(spans)
    args = ["plan", "--trace", str(spans), "--clients", "2", "--duration", "60", "--instances", "2,1"]
    code, out, err = _epd(args, capsys)
    assert code == 0, err
    assert "Layout(" not in out and "{" not in out  # no reprs, no dicts
    columns, kinds = parse_table(out, "kind ")
    assert set(kinds) == {"text", "image"} and columns[0] == "requests"
    assert kinds["text"][0] == "4" and kinds["image"][0] == "4"
    columns, rows = parse_table(out, "layout ")
    assert list(rows) == ["2E+1PD"]
    assert columns[:2] == ["instances", "p90_ttft_ms"] and rows["2E+1PD"][0] == "3"
    assert float(rows["2E+1PD"][1]) > 0

    code, out, err = _epd(["plan", "--trace", str(spans), "--rate", "0.5"], capsys)
    assert code == 0, err
    assert "recommended for p90 TTFT <= 5 s at 0.5 requests/s" in out
    _, rows = parse_table(out, "layout ")
    assert len(rows) == 1 and next(iter(rows)).endswith("PD")


@pytest.mark.parametrize(
    ("layout", "instances", "takes"),
    [("e+pd", "2,1,1", "2 counts, E,PD"), ("e/p/d", "2,1", "3 counts, E,P,D"), (None, "2,1,1", "2 counts, E,PD")],
)
def test_role_counts_that_do_not_fit_the_layout_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], layout: str | None, instances: str, takes: str
) -> None:
    spans = tmp_path / "spans.jsonl"
    _measured_run(spans)  # an e+pd run: the layout when --layout is not given
    args = ["plan", "--trace", str(spans), "--clients", "2", "--instances", instances]
    code, out, err = _epd([*args, *(["--layout", layout] if layout else [])], capsys)
    assert code == 2 and out == ""  # refused before anything is simulated or printed
    assert f"--instances {instances}: the {layout or 'e+pd'} layout takes {takes}" in err


def test_instances_must_be_whole_positive_counts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spans = tmp_path / "spans.jsonl"
    _measured_run(spans)
    for bad, why in (("2,x", "not whole numbers"), ("0,1", "at least one instance")):
        code, _, err = _epd(["plan", "--trace", str(spans), "--clients", "1", "--instances", bad], capsys)
        assert code == 2 and why in err
