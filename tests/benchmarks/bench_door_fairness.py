"""Benchmark (not a test): the door under long generations, bursts and idle connections (issue 65,
items 5 and 6 and the 1,000-connection bound). Results: docs/results/door-fairness.md.

An E/P/D stack with one encoder and the OpenAI door in the router's process (what `epd up --layout
e/p/d --encoders 1` starts), on the engine given, then three parts, each repeated (interleaved):

- `fairness`: time to first token of a short streamed chat request (16 tokens, `ignore_eos`) on an
  idle stack, and while N long streams (4,096 tokens, `ignore_eos`, read at full speed) decode; N
  from `--long` (e.g. 8, the old decode slots, and beyond the new 32). A short request refused
  (429) is counted with its status and the time its refusal took.
- `burst`: 1,024 chat requests sent at once on connections opened beforehand (half with a 64x80
  PNG data URL, half streamed, 16 tokens): how long each 429 took to arrive, how long a served one
  took, nothing lost (each a complete 200 or a 429 with Retry-After), and a greedy request answered
  the same before and after.
- `connections`: 1,000 connections to the door, half idle (nothing sent), half dribbling a
  request's headers a byte a second: the router process's resident memory and open files before,
  with all open, and after the door closed them; how long until the last was closed.

`--config before` runs the decode and router as they were before the fix (decode --max-batch 8
--max-running 8, router --decode-queue-s 0), for the fairness part's comparison.

    .venv/bin/python tests/benchmarks/bench_door_fairness.py --parts fairness,burst,connections --repeats 3
    .venv/bin/python tests/benchmarks/bench_door_fairness.py --parts fairness --config before --long 8 --shorts 1
    .venv/bin/python tests/benchmarks/bench_door_fairness.py --engine vllm --parts fairness --long 8
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from libs.launch.stack import Stack, StackSpec  # noqa: E402
from libs.model.checkpoints import ensure_checkpoint  # noqa: E402

LONG_TOKENS = 4096
SHORT_TOKENS = 16
BURST = 1024
CONNECTIONS = 1000
BEFORE = {"decode": ["--max-batch", "8", "--max-running", "8"], "router": ["--decode-queue-s", "0"]}


def png_data_url(width: int = 64, height: int = 80) -> str:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 40, 90)).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def chat_body(model: str, text: str, max_tokens: int, *, stream: bool, image: str | None = None) -> bytes:
    content: Any = text if image is None else [
        {"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": image}}
    ]  # fmt: skip
    body = {
        "model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
        "ignore_eos": True, "temperature": 0, "stream": stream,
    }  # fmt: skip
    return json.dumps(body).encode()


def http_request(host: str, body: bytes, close: bool = True) -> bytes:
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n{'connection: close' + chr(13) + chr(10) if close else ''}\r\n"
    )
    return head.encode() + body


@dataclass
class Answer:
    status: int = 0
    first_byte_s: float = 0.0  # status line
    sent_at: float = 0.0  # perf_counter when its request was written
    first_content_s: float = 0.0  # first SSE event with content (streams), or the whole body
    end_s: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    error: str = ""


async def exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes, timeout_s: float
) -> Answer:
    """Send `request` on an open connection (`connection: close`), read the answer to its end."""
    answer = Answer()
    started = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            writer.write(request)
            await writer.drain()
            answer.sent_at = time.perf_counter()
            status_line = await reader.readline()
            answer.first_byte_s = time.perf_counter() - started
            answer.status = int(status_line.split()[1])
            while (line := await reader.readline()) not in (b"\r\n", b""):
                key, _, value = line.decode().partition(":")
                answer.headers[key.strip().lower()] = value.strip()
            body = bytearray()
            while chunk := await reader.read(65536):
                if not answer.first_content_s and b'"content":"' in chunk:
                    answer.first_content_s = time.perf_counter() - started
                body += chunk
            answer.body = bytes(body)
    except (TimeoutError, OSError, ValueError, IndexError) as exc:
        answer.error = f"{type(exc).__name__}: {exc}"
    finally:
        answer.end_s = time.perf_counter() - started
        if not answer.first_content_s:
            answer.first_content_s = answer.end_s
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
    return answer


async def one(host: str, port: int, request: bytes, timeout_s: float) -> Answer:
    reader, writer = await asyncio.open_connection(host, port)
    return await exchange(reader, writer, request, timeout_s)


def complete(answer: Answer, stream: bool) -> bool:
    """A 200 whose answer ended as it should (the SSE's [DONE], or a chat completion object)."""
    if answer.status != 200 or answer.error:
        return False
    if stream:
        return b"data: [DONE]" in answer.body
    return b'"object":"chat.completion"' in answer.body


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


class Door:
    def __init__(self, stack: Stack, model: str) -> None:
        address = stack.door_url.removeprefix("http://").removesuffix("/v1")
        self.host, port = address.rsplit(":", 1)
        self.port = int(port)
        self.model = model
        # The process serving the door: the router's (placement router) or its own.
        self.router_pid = stack.processes.get("openai_door", stack.processes["router"]).pid

    def short(self) -> bytes:
        return http_request(self.host, chat_body(self.model, "short", SHORT_TOKENS, stream=True))


# -- fairness ---------------------------------------------------------------------------------------


async def long_streams(door: Door, n: int) -> tuple[list[asyncio.Task[None]], list[asyncio.Event]]:
    """`n` long streams, read at full speed; each event is set once its stream carries content."""
    started = [asyncio.Event() for _ in range(n)]

    async def run(i: int) -> None:
        reader, writer = await asyncio.open_connection(door.host, door.port)
        body = chat_body(door.model, f"long {i}", LONG_TOKENS, stream=True)
        writer.write(http_request(door.host, body))
        await writer.drain()
        try:
            while chunk := await reader.read(65536):
                if b'"content":"' in chunk or b" 429 " in chunk[:16]:
                    started[i].set()  # decoding (or refused: it holds nothing)
        finally:
            started[i].set()
            writer.close()

    return [asyncio.create_task(run(i)) for i in range(n)], started


async def fairness_round(door: Door, n_long: int, shorts: int) -> list[Answer]:
    tasks: list[asyncio.Task[None]] = []
    if n_long:
        tasks, started = await long_streams(door, n_long)
        async with asyncio.timeout(600):
            for each in started:
                await each.wait()
    answers = [await one(door.host, door.port, door.short(), timeout_s=300) for _ in range(shorts)]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    # The long streams' calls are cancelled with their connections: the next round starts idle.
    await one(door.host, door.port, door.short(), timeout_s=300)
    return answers


def summarize_fairness(rows: dict[int, list[list[Answer]]]) -> dict[str, Any]:
    """Per N: per repeat the p50/p99 TTFT of served shorts, the refusals; medians over repeats and range."""
    out: dict[str, Any] = {}
    for n, repeats in rows.items():
        p50s, p99s, refused, refusal_s = [], [], 0, []
        for answers in repeats:
            served = [a.first_content_s for a in answers if a.status == 200]
            if served:
                p50s.append(pct(served, 50))
                p99s.append(pct(served, 99))
            refused += sum(a.status == 429 for a in answers)
            refusal_s += [a.first_byte_s for a in answers if a.status == 429]
        statuses = sorted({a.status for answers in repeats for a in answers})
        out[str(n)] = {
            "ttft_p50_s": [statistics.median(p50s), min(p50s), max(p50s)] if p50s else None,
            "ttft_p99_s": [statistics.median(p99s), min(p99s), max(p99s)] if p99s else None,
            "refused": refused,
            "refusal_s": [statistics.median(refusal_s), min(refusal_s), max(refusal_s)] if refusal_s else None,
            "statuses": statuses,
            "requests": sum(len(a) for a in repeats),
            "refusal_message": next(
                (a.body.decode(errors="replace")[:300] for r in repeats for a in r if a.status == 429), None
            ),
        }
    return out


# -- burst ------------------------------------------------------------------------------------------


async def burst_round(door: Door, size: int) -> dict[str, Any]:
    image = png_data_url()
    probe = http_request(door.host, chat_body(door.model, "same", 8, stream=False))
    before = await one(door.host, door.port, probe, timeout_s=120)
    kinds = [(i % 2 == 0, (i // 2) % 2 == 0) for i in range(size)]  # (with image, streamed)
    requests = [
        http_request(door.host, chat_body(door.model, f"burst {i}", SHORT_TOKENS, stream=s, image=image if m else None))
        for i, (m, s) in enumerate(kinds)
    ]
    connections = [await asyncio.open_connection(door.host, door.port) for _ in range(size)]
    answers = await asyncio.gather(
        *(exchange(r, w, req, timeout_s=600) for (r, w), req in zip(connections, requests, strict=True))
    )
    after = await one(door.host, door.port, probe, timeout_s=120)
    sent = [a.sent_at for a in answers if a.sent_at]
    print(f"burst: the client wrote its {size} requests within {1000 * (max(sent) - min(sent)):.0f} ms", flush=True)
    refused = [a for a in answers if a.status == 429]
    served = [a for a, (_, s) in zip(answers, kinds, strict=True) if complete(a, s)]
    lost = [a for a, (_, s) in zip(answers, kinds, strict=True) if not complete(a, s) and a.status != 429]
    same = before.status == after.status == 200 and _content(before.body) == _content(after.body)
    return {
        "refused": len(refused),
        "refused_with_retry_after": sum("retry-after" in a.headers for a in refused),
        "served": len(served),
        "lost": len(lost),
        "lost_examples": [(a.status, a.error, a.body[:200].decode(errors="replace")) for a in lost[:3]],
        "refusal_ms": [1000 * a.first_byte_s for a in refused],
        "served_s": [a.end_s for a in served],
        "answered_the_same_after": same,
    }


def _content(body: bytes) -> str:
    with contextlib.suppress(ValueError, KeyError, IndexError):
        return str(json.loads(body.split(b"\r\n\r\n", 1)[-1])["choices"][0]["message"]["content"])
    return body.decode(errors="replace")


# -- connections ------------------------------------------------------------------------------------


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def connections_round(door: Door, n: int, limit_s: float = 120.0) -> dict[str, Any]:
    pid = door.router_pid
    before = (rss_mib(pid), open_files(pid))
    conns = [await asyncio.open_connection(door.host, door.port) for _ in range(n)]
    opened = time.perf_counter()
    head = http_request(door.host, b"{}", close=False)
    closed_at: list[float] = []

    async def hold(i: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(limit_s):
                pending = asyncio.ensure_future(reader.read())  # until the door closes the connection
                if i % 2:  # dribbling: one byte of the headers a second, until the door closes it
                    for byte in head:
                        if pending.done():
                            break
                        writer.write(bytes([byte]))
                        await asyncio.wait({pending}, timeout=1.0)
                await pending
        except (TimeoutError, OSError):
            pass
        finally:
            closed_at.append(time.perf_counter() - opened)
            writer.close()

    tasks = [asyncio.create_task(hold(i, r, w)) for i, (r, w) in enumerate(conns)]
    while len(closed_at) < n // 10 and time.perf_counter() - opened < 2.0:  # all open, none closed yet
        await asyncio.sleep(0.05)
    during = (rss_mib(pid), open_files(pid))
    await asyncio.gather(*tasks)
    await asyncio.sleep(1.0)  # the door's side of each close
    after = (rss_mib(pid), open_files(pid))
    return {
        "rss_mib": [before[0], during[0], after[0]],
        "open_files": [before[1], during[1], after[1]],
        "all_closed_s": max(closed_at),
        "closed_by_door": len(closed_at),
    }


# -- main -------------------------------------------------------------------------------------------


def start(engine: str, config: str, run_dir: Path, family: str, door_placement: str = "") -> tuple[Stack, str]:
    model = ensure_checkpoint(family, "tiny")
    spec = StackSpec(
        layout="e/p/d",
        encoders=1,
        model=model,
        run_dir=run_dir,
        engine=engine,
        openai_door=True,
        door_placement=door_placement,
        # vLLM: room for a prompt and 4,096 generated tokens (its default --max-model-len is 4,096).
        env={"EPD_WARM_UP": "true", **({"EPD_MAX_MODEL_LEN": "8192"} if engine == "vllm" else {})},
        extra_args=BEFORE if config == "before" else {},
        ready_timeout_s=600.0,
    )
    stack = Stack(spec)
    stack.up()
    return stack, model.name


async def run(ns: argparse.Namespace, door: Door) -> dict[str, Any]:
    parts = ns.parts.split(",")
    result: dict[str, Any] = {"engine": ns.engine, "config": ns.config, "repeats": ns.repeats}
    await one(door.host, door.port, door.short(), timeout_s=300)  # warm
    long_counts = [0, *[int(n) for n in ns.long.split(",")]]
    if "fairness" in parts:
        rows: dict[int, list[list[Answer]]] = {n: [] for n in long_counts}
        for repeat in range(ns.repeats):
            for n in long_counts:  # interleaved: idle, then each N, every repeat
                answers = await fairness_round(door, n, ns.shorts)
                rows[n].append(answers)
                shown = [f"{a.status}:{a.first_content_s * 1000:.0f}ms" for a in answers]
                print(f"fairness repeat {repeat} long={n}: {' '.join(shown)}", flush=True)
        result["fairness"] = summarize_fairness(rows)
    if "burst" in parts:
        rounds: list[dict[str, Any]] = []
        for repeat in range(ns.repeats):
            got = await burst_round(door, ns.burst)
            rounds.append(got)
            print(
                f"burst repeat {repeat}: served {got['served']} refused {got['refused']} lost {got['lost']} "
                f"429 p50 {pct(got['refusal_ms'], 50):.1f} ms p99 {pct(got['refusal_ms'], 99):.1f} ms "
                f"served p50 {pct(got['served_s'], 50):.2f} s same-after {got['answered_the_same_after']}",
                flush=True,
            )
        result["burst"] = [
            {k: v for k, v in r.items() if k not in ("refusal_ms", "served_s")}
            | {
                "refusal_ms_p50": pct(r["refusal_ms"], 50),
                "refusal_ms_p99": pct(r["refusal_ms"], 99),
                "refusal_ms_max": max(r["refusal_ms"], default=float("nan")),
                "served_s_p50": pct(r["served_s"], 50),
                "served_s_min_max": [min(r["served_s"], default=0), max(r["served_s"], default=0)],
            }
            for r in rounds
        ]
    if "connections" in parts:
        held: list[dict[str, Any]] = []
        for repeat in range(ns.repeats):
            outcome = await connections_round(door, ns.connections)
            held.append(outcome)
            print(f"connections repeat {repeat}: {outcome}", flush=True)
        result["connections"] = held
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["reference", "vllm"], default="reference")
    parser.add_argument("--family", default="qwen2_5_omni", help="tiny checkpoint family (vLLM: qwen2_5_vl)")
    parser.add_argument("--config", choices=["after", "before"], default="after")
    parser.add_argument("--parts", default="fairness,burst,connections")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--long", default="8,34", help="long streams running, comma-separated (idle is added)")
    parser.add_argument("--shorts", type=int, default=8, help="short requests per round, one after the other")
    parser.add_argument("--burst", type=int, default=BURST)
    parser.add_argument("--connections", type=int, default=CONNECTIONS)
    parser.add_argument("--door-placement", choices=["router", "process"], default="router")
    parser.add_argument("--out", type=Path, default=None)
    ns = parser.parse_args(argv)
    run_dir = ROOT / "var/run/bench-door-fairness" / f"{ns.engine}-{ns.config}-{os.getpid()}"
    stack, model = start(ns.engine, ns.config, run_dir, ns.family, ns.door_placement)
    try:
        door = Door(stack, model)
        result = asyncio.run(run(ns, door))
    finally:
        stack.down()
    text = json.dumps(result, indent=1, default=str)
    print(text)
    if ns.out is not None:
        ns.out.parent.mkdir(parents=True, exist_ok=True)
        ns.out.write_text(text)
    return result


@pytest.mark.bench
def test_bench_door_fairness_smoke() -> None:
    """The benchmark at smoke size (`-m bench`): one repeat of each part, nothing lost."""
    result = main(["--repeats", "1", "--long", "8", "--shorts", "2", "--burst", "256", "--connections", "200"])
    assert all(r["lost"] == 0 for r in result["burst"])


if __name__ == "__main__":
    main()
