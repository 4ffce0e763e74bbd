"""Cross-version interoperation with live processes: services of the contract 1.0 release (run from
a checkout of that commit) and current services (contract 1.1 or later) in one stack, for both handoffs in
both directions, and a rolling upgrade of a running stack, one service at a time, under load: from
1.0 to the current release, then a restart of every current service (the current drain code)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from libs.client.generate import GenerationResult, generate, open_channel
from libs.contract.epd.v1 import service_info_pb2, service_info_pb2_grpc
from libs.contract.version import CONTRACT_MAJOR, CONTRACT_MINOR
from libs.launch.process import ROOT, ServiceProcess, free_port
from tests.support.golden import request_for
from tests.support.release_tree import release_checkout
from tests.support.stacks import MIXES, wait_for

pytestmark = pytest.mark.stack

RELEASE_1_0 = "Release contract v1.0"
MIX_NAMES = ["text", "image", "audio_image", "video"]
UPGRADE_ORDER = ["router", "encoder-0", "encoder-1", "prefill", "decode"]


@pytest.fixture(scope="module")
def v1_0_tree(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A checkout of the commit that released contract 1.0 (its services speak 1.0)."""
    with release_checkout(RELEASE_1_0, tmp_path_factory.mktemp("v1_0")) as path:
        yield path


# The 1.0 release predates `TransferConfig.ucx_modules`: where libibverbs is installed (it is, for
# Mooncake), its UCX loads the InfiniBand modules and crashes at exit unless told not to.
OLD_ENV = {"UCX_MODULES": "^ib"}


def _start(name: str, module: str, root: Path, args: list[str], logs: Path) -> ServiceProcess:
    env = OLD_ENV if root != ROOT else {}
    process = ServiceProcess(name, module, args, log_path=logs / f"{name}-{root.name}.log", root=root, env=env)
    process.start()
    return process


def _contract(address: str) -> tuple[int, int]:
    with grpc.insecure_channel(address) as channel:
        info = service_info_pb2_grpc.ServiceInfoServiceStub(channel).GetServiceInfo(
            service_info_pb2.GetServiceInfoRequest(), timeout=10
        )
    return info.info.contract_version.major, info.info.contract_version.minor


def _model_args(model: Path) -> list[str]:
    return ["--model", str(model), "--torch-threads", "1", "--pool-mib", "64"]


def _backends(
    model: Path, roots: dict[str, Path], logs: Path, ports: dict[str, int] | None = None
) -> dict[str, ServiceProcess]:
    model_args = _model_args(model)
    procs = {}
    for name, module in (
        ("encoder-0", "services.encoder"),
        ("prefill", "services.prefill"),
        ("decode", "services.decode"),
    ):
        port = ["--port", str(ports[name])] if ports else []
        procs[name] = _start(name, module, roots[name], [*model_args, *port], logs)
    for process in procs.values():
        process.wait_ready(120)
    return procs


def _router(
    root: Path, procs: dict[str, ServiceProcess], logs: Path, encoders: list[str], port: int = 0
) -> ServiceProcess:
    router = _start(
        "router",
        "services.router",
        root,
        [
            "--port", str(port),
            "--encoders", ",".join(encoders),
            "--prefill", procs["prefill"].address,
            "--decode", procs["decode"].address,
        ],
        logs,
    )  # fmt: skip
    router.wait_ready(60)
    return router


# Stack A: old encoder -> new prefill (E->P old->new), new prefill -> old decode (P->D new->old).
# Stack B: new encoder -> old prefill (E->P new->old), old prefill -> new decode (P->D old->new).
MATRIX = {
    "A": {"encoder-0": "old", "prefill": "new", "decode": "old"},
    "B": {"encoder-0": "new", "prefill": "old", "decode": "new"},
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stack", sorted(MATRIX))
def test_cross_version_handoffs(
    stack: str, v1_0_tree: Path, model_path: Path, expected: dict[str, list[int]], tmp_path: Path
) -> None:
    roots = {name: (v1_0_tree if version == "old" else ROOT) for name, version in MATRIX[stack].items()}
    procs = _backends(model_path, roots, tmp_path)
    router = None
    try:
        for name, version in MATRIX[stack].items():
            assert _contract(procs[name].address) == ((1, 0) if version == "old" else (CONTRACT_MAJOR, CONTRACT_MINOR))
        router = _router(ROOT, procs, tmp_path, [procs["encoder-0"].address])
        requests = [request_for(MIXES[name], request_id=f"x{stack}-{name}") for name in MIX_NAMES]
        for request in requests:
            request.priority = 7  # honored by the 1.1 peers; never set on calls to 1.0 peers

        async def run() -> list[GenerationResult]:
            async with open_channel(router.address) as channel:
                return [await generate(channel, r, timeout_s=60) for r in requests]

        results = asyncio.run(run())
        want = {n: expected[n] for n in MIX_NAMES}
        if MATRIX[stack]["encoder-0"] == "old":
            # Preprocessing is the encoder's, and video's changed after 1.0 (pixels and timing now
            # equal the family processor's): behind a 1.0 encoder the video tokens are the ones the
            # 1.0 release itself produces, end to end.
            old_prefill = _start("prefill-1.0", "services.prefill", v1_0_tree, _model_args(model_path), tmp_path)
            procs["prefill-1.0"] = old_prefill
            old_prefill.wait_ready(120)
            old_router = _router(
                v1_0_tree, {"prefill": old_prefill, "decode": procs["decode"]}, tmp_path, [procs["encoder-0"].address]
            )
            procs["router-1.0"] = old_router

            async def old_release() -> GenerationResult:
                async with open_channel(old_router.address) as channel:
                    return await generate(channel, request_for(MIXES["video"], request_id="x-1.0-video"), timeout_s=60)

            want["video"] = asyncio.run(old_release()).token_ids
        assert {n: r.token_ids for n, r in zip(MIX_NAMES, results, strict=True)} == want
    finally:
        for process in [router, *procs.values()]:
            if process is not None:
                assert process.stop() == 0, process.log_tail()


@pytest.mark.timeout(1200)
def test_rolling_upgrade_under_load(
    v1_0_tree: Path, model_path: Path, expected: dict[str, list[int]], tmp_path: Path
) -> None:
    names = ["encoder-0", "encoder-1", "prefill", "decode", "router"]
    ports: dict[str, int] = {}
    while len(set(ports.values())) < len(names):  # fixed and distinct, for the whole upgrade
        ports = {name: free_port() for name in names}
    # Drain promises "no request lost" for requests that finish within the grace period; give them
    # one long enough for a 2-core machine that is busy with other work too (10 s was not, once).
    grace = ["--grace-s", "60"]
    model_args = ["--model", str(model_path), "--torch-threads", "1", "--pool-mib", "64", *grace]
    modules = {
        "encoder-0": "services.encoder",
        "encoder-1": "services.encoder",
        "prefill": "services.prefill",
        "decode": "services.decode",
    }
    address = {name: f"127.0.0.1:{port}" for name, port in ports.items()}

    def args(name: str) -> list[str]:
        if name == "router":
            return [
                "--port", str(ports["router"]),
                "--encoders", f"{address['encoder-0']},{address['encoder-1']}",
                "--prefill", address["prefill"],
                "--decode", address["decode"],
                *grace,
            ]  # fmt: skip
        return [*model_args, "--port", str(ports[name])]

    def module(name: str) -> str:
        return modules.get(name, "services.router")

    running = {name: _start(name, module(name), v1_0_tree, args(name), tmp_path) for name in names[:-1]}
    for process in running.values():
        process.wait_ready(120)
    running["router"] = _start("router", "services.router", v1_0_tree, args("router"), tmp_path)
    running["router"].wait_ready(60)
    assert {_contract(address[n]) for n in names} == {(1, 0)}

    upgraded = threading.Event()
    log: list[str] = []
    marks: list[float] = []  # monotonic instants: each stopped process gone, each replacement ready

    def served_since(instant: float) -> bool:
        return any(begun > instant for begun, _ in spans[:])

    def replace_each(label: str) -> None:
        # The router first (docs/contract-evolution.md): from then on a router of this release covers
        # the restarts behind it, including a decode restart that outlives prefill's KV lease.
        for name in UPGRADE_ORDER:  # one at a time: drain the running process, start its replacement on its port
            # The stack serves again (the last replacement too): a request sent since it was ready is done.
            since = marks[-1] if marks else 0.0
            wait_for(lambda s=since: served_since(s), 300, f"a request served before {label} {name}")
            status = running[name].stop(timeout_s=90)
            log.append(f"{label} {name}: stopped {status}")
            marks.append(time.monotonic())
            new = _start(name, module(name), ROOT, args(name), tmp_path)
            running[name] = new
            new.wait_ready(120)
            log.append(f"{label} {name}: ready")
            marks.append(time.monotonic())

    def upgrade() -> None:
        try:
            replace_each("1.0->current")  # the upgrade: old drain code, new services
            replace_each("current->current")  # a restart of the new release: the current drain code
        except Exception as exc:
            log.append(f"failed: {exc}")  # shown by the log's check below
            raise
        finally:
            upgraded.set()

    plan = ["image", "text", "audio", "two_images"]

    spans: list[tuple[float, float]] = []  # when each request started and completed

    async def load() -> tuple[list[tuple[str, GenerationResult | str]], int]:
        outcomes: list[tuple[str, GenerationResult | str]] = []
        sent = 0
        started = time.monotonic()
        async with open_channel(address["router"]) as channel:

            async def worker() -> None:
                nonlocal sent
                # Until the whole upgrade is done (and 24 requests at least), whatever the count; the
                # time bound only stops a hung upgrade (checked below).
                while (not upgraded.is_set() or sent < 24) and time.monotonic() - started < 900:
                    name = plan[sent % len(plan)]
                    sent += 1
                    request = request_for(MIXES[name])
                    begun = time.monotonic()
                    try:
                        outcomes.append((name, await generate(channel, request, timeout_s=300, retry_unavailable=True)))
                        spans.append((begun, time.monotonic()))
                    except grpc.aio.AioRpcError as exc:
                        outcomes.append((name, f"{exc.code().name}: {exc.details()}"))

            await asyncio.gather(*(worker() for _ in range(4)))
        return outcomes, sent

    thread = threading.Thread(target=upgrade)
    thread.start()
    final: dict[str, int | None] = {}
    try:
        outcomes, sent = asyncio.run(load())
        load_ended = time.monotonic()
    finally:
        thread.join(300)
        final = {name: process.stop() for name, process in running.items()}
    assert log == [
        f"{label} {n}: {step}"
        for label in ("1.0->current", "current->current")
        for n in UPGRADE_ORDER
        for step in ("stopped 0", "ready")
    ]
    assert final == dict.fromkeys(names, 0), {n: running[n].log_tail() for n, code in final.items() if code}
    failed = [(n, o) for n, o in outcomes if isinstance(o, str)]
    assert not failed, failed[:5]
    assert len(outcomes) == sent >= 24
    assert marks[-1] < load_ended, "the load stopped (its time bound) before the upgrade was done"
    # The load ran through every step: requests were in flight while each process was replaced.
    for gone, ready in zip(marks[::2], marks[1::2], strict=True):
        assert any(begun < ready and done > gone for begun, done in spans), (gone, ready)
    wrong = [n for n, o in outcomes if not isinstance(o, str) and o.token_ids != expected[n]]
    assert not wrong
    retried = Counter(code for _, o in outcomes if not isinstance(o, str) for code in o.retried_codes)
    print(f"rolling upgrade: {sent} requests sent, {len(outcomes) - len(failed)} completed, {len(failed)} failed; "
          f"client retries {dict(retried)}")  # fmt: skip
