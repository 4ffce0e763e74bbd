"""Stage metrics reach a real Prometheus endpoint of a running service (`--metrics-port`)."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest

from libs.launch.k8s import LANE_LABEL, OCCUPANCY_METRIC
from libs.launch.process import ServiceProcess, free_port
from tests.support.golden import request_for
from tests.support.stacks import MIXES, run_requests

pytestmark = pytest.mark.integration


@pytest.mark.timeout(120)
def test_prometheus_endpoint_serves_stage_histograms(model_path: Path, tmp_path: Path) -> None:
    port = free_port()
    service = ServiceProcess(
        "colocated",
        "services.colocated",
        ["--model", str(model_path), "--metrics-port", str(port)],
        log_path=tmp_path / "colocated.log",
    )
    service.start()
    try:
        service.wait_ready(60)
        run_requests(service.address, [request_for(MIXES["image"])])
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        assert service.stop() == 0
    stages = {line.split('epd_stage="')[1].split('"')[0] for line in text.splitlines() if 'epd_stage="' in line}
    assert {"queue", "preprocess", "encode", "prefill", "decode"} <= stages
    assert "epd_stage_duration_seconds_bucket" in text
    # The load gauge an autoscaler reads (the encoder pool's HPA in deploy/k8s names it): idle now.
    gauge = [line for line in text.splitlines() if line.startswith(OCCUPANCY_METRIC + "{")]
    assert any(f'{LANE_LABEL}="colocated"' in line and line.endswith(" 0.0") for line in gauge), gauge
