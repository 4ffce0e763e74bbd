"""`make bench-vs-vllm`'s pure parts (tests/benchmarks/peers/vs_vllm.py and vllm_proxy.py): the
ratio maths, the run schedule, bench serve's arguments, and the requests the proxy sends each stage;
plus the proxy relaying in-process against fake stages, and a smoke run marked bench."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from tests.benchmarks.peers import vllm_proxy, vs_vllm

ROOT = Path(__file__).resolve().parents[2]

CHAT = {
    "model": "m",
    "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "text", "text": "hi"},
    ]}],
    "max_tokens": 16, "max_completion_tokens": 16, "stream": True,
    "stream_options": {"include_usage": True}, "ignore_eos": True,
}  # fmt: skip


@pytest.mark.unit
def test_median_and_range_ignore_missing_values() -> None:
    assert vs_vllm.median_range([3.0, 1.0, math.nan, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    empty = vs_vllm.median_range([math.nan])
    assert empty["n"] == 0 and math.isnan(empty["median"])


@pytest.mark.unit
def test_ratios_pair_by_repeat_and_drop_a_missing_side() -> None:
    assert vs_vllm.ratios([10.0, 20.0, 30.0], [20.0, 10.0, 30.0]) == [0.5, 2.0, 1.0]
    assert vs_vllm.ratios([10.0, math.nan, 5.0], [5.0, 1.0, 0.0]) == [2.0]  # NaN and a zero peer left out
    assert vs_vllm.ratios([1.0, 2.0], [1.0]) == [1.0]  # a repeat the peer lacks has no ratio


@pytest.mark.unit
def test_a_win_needs_the_whole_range_on_epds_side() -> None:
    lower = vs_vllm.median_range([0.8, 0.95, 1.0])
    assert vs_vllm.wins("median_ttft_ms", lower)  # latency: every ratio <= 1
    assert not vs_vllm.wins("median_ttft_ms", vs_vllm.median_range([0.8, 1.01]))
    assert vs_vllm.wins("output_throughput", vs_vllm.median_range([1.0, 1.2]))  # throughput: every ratio >= 1
    assert not vs_vllm.wins("output_throughput", lower)
    assert not vs_vllm.wins("output_throughput", vs_vllm.median_range([]))


@pytest.mark.unit
def test_every_epd_configuration_has_vllms_deployment_of_its_layout_as_peer() -> None:
    epd = [c for c in vs_vllm.CONFIGS if c.startswith("epd-")]
    assert {"epd-e+pd", "epd-e/p/d", "epd-e+pd-traced", "epd-e/p/d-dgate"} <= set(epd)
    for config in epd:  # "epd-<layout>[-variant]" against "vllm-<layout>"
        assert vs_vllm.PEERS[config] == "vllm-" + config.split("-")[1], config
    assert all(peer in vs_vllm.CONFIGS for peer in vs_vllm.PEERS.values())
    assert set(vs_vllm.MATRIX) <= set(vs_vllm.CONFIGS)
    assert {vs_vllm.PEERS[c] for c in vs_vllm.MATRIX if c.startswith("epd-")} == {"vllm-e+pd", "vllm-e/p/d"}


@pytest.mark.unit
def test_epd_configurations_measure_what_epd_up_deploys(tmp_path: Path) -> None:
    """The door where `epd up` puts it unless told (`default_door_placement`: the bench follows the
    default); `-doorproc` the other placement."""
    from libs.launch.stack import DOOR_PROCESS, default_door_placement

    for layout in ("e+pd", "e/p/d"):
        plain = vs_vllm.epd_spec(f"epd-{layout}-placed", tmp_path, tmp_path, 60.0)
        assert (plain.layout, plain.openai_door, plain.placement) == (layout, True, True)
        assert plain.door_placement == default_door_placement(layout)
        apart = vs_vllm.epd_spec(f"epd-{layout}-doorproc", tmp_path, tmp_path, 60.0)
        assert apart.door_placement == DOOR_PROCESS and apart.layout == layout
    assert vs_vllm.epd_spec("epd-e+pd-vllmenc-traced", tmp_path, tmp_path, 60.0).encoder_engine == "vllm"
    assert not [c for c in vs_vllm.CONFIGS if "uvloop" in c]


@pytest.mark.unit
def test_configuration_suffixes_are_read_in_any_order() -> None:
    suffixes = (vs_vllm.PLACED, vs_vllm.VLLM_ENCODER, vs_vllm.COMPILED)
    expected = ("e+pd", frozenset(suffixes))
    assert vs_vllm.without_suffixes("e+pd-vllmenc-placed-compiled", suffixes) == expected
    assert vs_vllm.without_suffixes("e+pd-compiled-vllmenc-placed", suffixes) == expected
    assert vs_vllm.without_suffixes("e/p/d", suffixes) == ("e/p/d", frozenset())
    # One role's engine eager is not every engine eager: the suffixes share their tail.
    assert vs_vllm.without_suffixes("e/p/d-placed-prefilleager", vs_vllm.EPD_SUFFIXES) == (
        "e/p/d",
        frozenset({vs_vllm.PLACED, vs_vllm.PREFILL_EAGER}),
    )
    assert vs_vllm.without_suffixes("e/p/d-placed-eager", vs_vllm.EPD_SUFFIXES) == (
        "e/p/d",
        frozenset({vs_vllm.PLACED, vs_vllm.EAGER}),
    )
    assert vs_vllm.without_suffixes("vllm-e+pd-compiled", (vs_vllm.ONE_PROCESS, vs_vllm.COMPILED)) == (
        "vllm-e+pd",
        frozenset({vs_vllm.COMPILED}),
    )


@pytest.mark.unit
def test_the_schedule_interleaves_configurations() -> None:
    assert vs_vllm.schedule(["a", "b", "c"], 2) == [(0, "a"), (0, "b"), (0, "c"), (1, "a"), (1, "b"), (1, "c")]


@pytest.mark.unit
def test_points_bound_prompts_and_give_each_point_its_own_seed() -> None:
    pts = vs_vllm.points(["1img", "3img"], [1, 4, 64], 48, 128)
    assert [(p.dataset, p.concurrency, p.prompts) for p in pts[:3]] == [
        ("1img", 1, 48),
        ("1img", 4, 48),
        ("1img", 64, 128),
    ]
    assert len({p.seed for p in pts}) == len(pts)
    assert vs_vllm.points(["1img"], [16], 8, 8)[0].prompts == 16  # at least one prompt per slot


@pytest.mark.unit
def test_bench_serve_arguments_name_the_dataset_seed_and_percentiles(tmp_path: Path) -> None:
    point = vs_vllm.Point("3img", 4, 48, seed=1234)
    argv = vs_vllm.bench_serve_args(base_url="http://h:1", model="m", tokenizer="/t", dataset=vs_vllm.DATASETS["3img"],
                                    point=point, result_dir=tmp_path, filename="x.json")  # fmt: skip

    def value(flag: str) -> str:
        return argv[argv.index(flag) + 1]

    assert argv[:4] == ["bench", "serve", "--backend", "openai-chat"]
    assert value("--dataset-name") == "random-mm" and value("--seed") == "1234"
    assert json.loads(value("--random-mm-limit-mm-per-prompt")) == {"image": 3, "video": 0}
    assert (
        value("--random-mm-base-items-per-request") == "3"
        and value("--random-mm-bucket-config") == "{(224,224,1): 1.0}"
    )
    assert value("--random-output-len") == "16" and "--ignore-eos" in argv
    assert value("--request-rate") == "inf"  # bench serve's own default: as fast as answered
    paced = vs_vllm.bench_serve_args(base_url="http://h:1", model="m", tokenizer="/t", dataset=vs_vllm.DATASETS["3img"],
                                     point=vs_vllm.points(["3img"], [4], 48, 48, rate=12.5)[0], result_dir=tmp_path,
                                     filename="x.json")  # fmt: skip
    assert paced[paced.index("--request-rate") + 1] == "12.5"
    assert value("--max-concurrency") == "4" and value("--num-prompts") == "48"
    assert value("--metric-percentiles") == "50,90,99"


@pytest.mark.unit
def test_metrics_and_summary_from_result_files() -> None:
    def result(ttft: float, tput: float) -> dict[str, Any]:
        return {"median_ttft_ms": ttft, "p90_ttft_ms": ttft, "p99_ttft_ms": ttft, "median_tpot_ms": 5.0,
                "request_throughput": tput / 16, "output_throughput": tput, "completed": 48, "failed": 0}  # fmt: skip

    results = vs_vllm.Results()
    point = vs_vllm.Point("1img", 4, 48, seed=1)
    for ours, peer, flat in ((10, 20, 5), (30, 20, 5), (20, 20, 5)):
        results.add("epd-e+pd", point, vs_vllm.metrics_of(result(ours, 100)))
        results.add("vllm-e+pd", point, vs_vllm.metrics_of(result(peer, 50)))
        results.add("vllm-unsplit", point, vs_vllm.metrics_of(result(flat, 200)))
    summary = results.summary()["1img@c4"]
    ttft = summary["vs_peer"]["epd-e+pd/vllm-e+pd"]["median_ttft_ms"]
    assert (ttft["median"], ttft["min"], ttft["max"]) == (1.0, 0.5, 1.5)
    assert summary["vs_peer"]["epd-e+pd/vllm-e+pd"]["output_throughput"]["median"] == 2.0
    assert summary["vs_unsplit"]["vllm-e+pd/vllm-unsplit"]["median_ttft_ms"]["median"] == 4.0
    assert summary["configs"]["epd-e+pd"]["median_ttft_ms"]["median"] == 20.0
    text = vs_vllm.table(results.summary())
    assert "| 1img@c4 | epd-e+pd/vllm-e+pd | 1.00 (0.50-1.50) |" in text
    assert "**2.00**" in text  # throughput ratio 2.0 in every repeat: a win, shown bold
    assert "epd-e+pd/vllm-e+pd-uni" not in text  # not run: no ratio

    for _ in range(3):  # vLLM's deployment with one engine process too: EPD's ratio against it as well
        results.add("vllm-e+pd-uni", point, vs_vllm.metrics_of(result(10, 100)))
    tuned = results.summary()["1img@c4"]["vs_peer"]["epd-e+pd/vllm-e+pd-uni"]
    assert tuned["median_ttft_ms"]["median"] == 2.0 and tuned["output_throughput"]["median"] == 1.0


def _one_point_summary(result: dict[str, Any]) -> dict[str, Any]:
    results = vs_vllm.Results()
    results.add("epd-e+pd", vs_vllm.Point("1img", 1, 4, seed=1), vs_vllm.metrics_of(result))
    return results.summary()


@pytest.mark.unit
def test_arrivals_count_the_separate_moments_an_answer_streamed_tokens() -> None:
    streamed = [0.004] * 15  # 16 tokens, one every 4 ms
    burst = [0.0, 0.00002, 0.0] + [0.00001] * 12  # 16 tokens parsed from one read
    two_reads = [0.0] * 7 + [0.050] + [0.0] * 7  # half the answer, then the rest 50 ms later
    result = {"ttfts": [0.02, 0.3, 0.1, 0.0], "itls": [streamed, burst, two_reads, []],  # the last one failed
              "latencies": [0.08, 0.3002, 0.15, 0.0], "output_lens": [16, 16, 16, 0]}  # fmt: skip
    assert vs_vllm.arrivals(result) == 2.0  # median of 16, 1, 2
    assert vs_vllm.arrivals({"ttfts": [0.3], "itls": [burst], "latencies": [0.3], "output_lens": [16]}) == 1.0
    assert math.isnan(vs_vllm.arrivals({"median_ttft_ms": 1.0}))  # saved without --save-detailed
    metrics = vs_vllm.metrics_of(result)
    assert metrics["median_arrivals"] == 2.0
    # One answer of the three streamed: its TPOT alone, (0.08 - 0.02) s / 15 tokens = 4 ms.
    assert metrics["streamed_share"] == pytest.approx(100 / 3)
    assert metrics["streamed_tpot_ms"] == pytest.approx(4.0)
    three_reads = [0.0] * 4 + [0.010] + [0.0] * 4 + [0.020] + [0.0] * 5  # three moments: streamed
    more = {**result, "ttfts": [*result["ttfts"], 0.05], "itls": [*result["itls"], three_reads],
            "latencies": [*result["latencies"], 0.2], "output_lens": [*result["output_lens"], 16]}  # fmt: skip
    assert vs_vllm.streamed_share(more) == 50.0
    assert vs_vllm.streamed_tpot(more) == pytest.approx((4.0 + 10.0) / 2)  # (0.2 - 0.05) s / 15 = 10 ms
    assert math.isnan(vs_vllm.streamed_tpot({"ttfts": [0.3], "itls": [burst], "latencies": [0.3], "output_lens": [16]}))
    assert "33.3" in vs_vllm.table(_one_point_summary(result))  # the share beside the figures
    argv = vs_vllm.bench_serve_args(base_url="http://127.0.0.1:1", model="m", tokenizer="t",
                                    dataset=vs_vllm.DATASETS["1img"], point=vs_vllm.Point("1img", 1, 1, seed=1),
                                    result_dir=Path("r"), filename="f.json")  # fmt: skip
    assert "--save-detailed" in argv  # the per-request gaps the count needs


@pytest.mark.unit
def test_the_proxy_shapes_each_stage_as_vllms_example_does() -> None:
    assert vllm_proxy.has_media(CHAT)
    assert not vllm_proxy.has_media({"messages": [{"role": "user", "content": "text only"}]})
    enc = vllm_proxy.encoder_request(CHAT)
    assert enc["max_tokens"] == 1 and enc["max_completion_tokens"] == 1 and enc["stream"] is False
    assert "stream_options" not in enc and enc["messages"] == CHAT["messages"]
    pre = vllm_proxy.prefill_request(CHAT)
    assert pre["max_tokens"] == 1 and pre["kv_transfer_params"]["do_remote_decode"] is True
    assert CHAT["max_tokens"] == 16 and "kv_transfer_params" not in CHAT  # the original is left alone
    dec = vllm_proxy.decode_request(CHAT, {"kv_transfer_params": {"remote_engine_id": "p"}})
    assert dec["kv_transfer_params"] == {"remote_engine_id": "p"} and dec["stream"] is True
    assert "kv_transfer_params" not in vllm_proxy.decode_request(CHAT, None)


@pytest.mark.unit
def test_the_proxy_calls_encoder_prefill_then_relays_decode() -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    asyncio.run(_drive_proxy(seen))
    assert [name for name, _ in seen] == ["encoder", "prefill", "decode", "prefill", "decode"]  # no encoder for text
    assert seen[0][1]["max_tokens"] == 1 and seen[2][1]["kv_transfer_params"] == {"k": 1}


async def _drive_proxy(seen: list[tuple[str, dict[str, Any]]]) -> None:
    def stage(name: str, answer: dict[str, Any]) -> web.Application:
        async def chat(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            seen.append((name, body))
            if name != "decode":
                return web.json_response(answer)
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            await out.write(b"data: one\n\n")
            await out.write(b"data: [DONE]\n\n")
            return out

        application = web.Application()
        application.router.add_post("/v1/chat/completions", chat)
        return application

    servers = [TestServer(stage("encoder", {})), TestServer(stage("prefill", {"kv_transfer_params": {"k": 1}})),
               TestServer(stage("decode", {}))]  # fmt: skip
    for s in servers:
        await s.start_server()
    try:
        url = [str(s.make_url("")).rstrip("/") for s in servers]
        proxy = vllm_proxy.Proxy(url[0], url[1], url[2], timeout_s=30)
        async with TestClient(TestServer(vllm_proxy.app(proxy))) as client:
            resp = await client.post("/v1/chat/completions", json=CHAT)
            assert resp.status == 200
            assert await resp.text() == "data: one\n\ndata: [DONE]\n\n"
            text_only = {**CHAT, "messages": [{"role": "user", "content": "no media"}]}
            assert (await client.post("/v1/chat/completions", json=text_only)).status == 200
            assert (await client.post("/v1/chat/completions", data=b"not json")).status == 400
    finally:
        for s in servers:
            await s.close()


@pytest.mark.bench
def test_quick_run_of_vllms_unsplit_serve(tmp_path: Path) -> None:
    """Smoke: the driver starts one configuration, measures it with vLLM's client, writes its files."""
    out = tmp_path / "smoke"
    argv = [sys.executable, "tests/benchmarks/bench_vs_vllm.py", "--quick", "--configs", "vllm-unsplit",
            "--datasets", "1img", "--out", str(out.relative_to(ROOT) if out.is_relative_to(ROOT) else out)]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads(out.with_suffix(".json").read_text())
    assert not doc["errors"]
    c1 = doc["summary"]["1img@c1"]["configs"]["vllm-unsplit"]
    assert c1["median_ttft_ms"]["n"] == 1 and c1["output_throughput"]["median"] > 0
