"""`epd` command line.

epd up --layout e/p/d --encoders 2           # start a stack on loopback; Ctrl-C stops it
epd up --config deploy/stacks/e-p-d.yaml     # ... as a stack description says
epd generate --image cat.png "What is this?"  # stream a reply from a running router
epd transcribe speech.wav                     # a transcript from a running Whisper stack
epd trace report                              # the latest run's time to first token by stage
epd demo                                      # what `make run` does
epd speech-demo                               # ... and then this (Whisper E/P/D)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import grpc

from libs.backends.engines import encoder_refusal, model_type, refusal
from libs.cli.help import EpdParser
from libs.cli.router_client import (
    ADDRESS_FILE,
    DEFAULT_RUN_DIR,
    Served,
    UsageError,
    router_target,
    stream_to_stdout,
)
from libs.client.generate import build_request, media_from_file
from libs.contract.epd.v1 import media_pb2, sampling_pb2
from libs.launch import rundir, runs
from libs.launch.config import DescriptionError, load_description, stack_spec
from libs.launch.placement import Placement
from libs.launch.stack import (
    DOOR_IN_ROUTER,
    DOOR_PLACEMENTS,
    LAYOUTS,
    Stack,
    StackSpec,
    default_door_placement,
)

DEFAULT_MODEL = Path("var/models/qwen2_5_omni-tiny")


def ensure_model(path: Path) -> Path:
    """The default tiny checkpoint is generated on first use, and again when its recipe changed
    (seeded, no download)."""
    if path != DEFAULT_MODEL:
        if not (path / "config.json").exists():
            raise SystemExit(f"epd: no checkpoint at {path} (config.json missing)")
        return path
    from libs.model.checkpoints import ensure_checkpoint  # torch import only when needed

    print(f"checking the tiny Qwen2.5-Omni checkpoint in {path} ...", file=sys.stderr)
    return ensure_checkpoint("qwen2_5_omni", "tiny")


def _stack_args(parser: argparse.ArgumentParser) -> None:
    # Defaults are None so that a flag given beside --config can be told apart (see _spec).
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help="a stack description (deploy/stacks/*.yaml): layout, roles, model, transport, cache, TLS from the file",
    )
    parser.add_argument("--layout", choices=LAYOUTS, default=None, help="deployment layout (default: e/p/d)")
    parser.add_argument("--encoders", type=int, default=None, help="encoder processes (default: 2)")
    parser.add_argument(
        "--engine",
        choices=("reference", "vllm"),
        default=None,
        help="engine of the PD service (e+pd) or of prefill and decode (e/p/d): the reference runtime, or vLLM "
        "(slower to start and heavier per service: docs/results/vllm.md)",
    )
    parser.add_argument(
        "--encoder-engine",
        choices=("reference", "vllm"),
        default=None,
        help="engine of the encoders: the reference runtime, or vLLM encoder-only (Qwen2.5-VL, Qwen3-VL; any LM "
        "engine whose embedding contract matches)",
    )
    parser.add_argument("--model", type=Path, default=None, help=f"checkpoint directory (default: {DEFAULT_MODEL})")
    parser.add_argument(
        "--run-dir",
        type=Path,
        default=DEFAULT_RUN_DIR,
        help="the stack's directory: the router address its clients read, TLS material, and a directory per run "
        "(runs/ID, the latest linked as latest) with that run's logs and spans; one stack at a time in each",
    )
    parser.add_argument(
        "--trace-exporter", choices=("none", "jsonl", "otlp"), default="jsonl", help="where services send spans"
    )
    parser.add_argument(
        "--trace-file",
        type=Path,
        default=None,
        help="span file, for jsonl (default: spans.jsonl in the run's directory, RUN_DIR/runs/ID/; `epd up` "
        "appends to a file given here, run after run, and the trace report tells the runs apart by time)",
    )
    parser.add_argument("--otlp-endpoint", default="127.0.0.1:4317", help="collector address, for otlp")
    parser.add_argument(
        "--cache-store",
        action="store_true",
        default=None,
        help="start a Mooncake Store (master + holder) that the encoders share and the router looks items up in",
    )
    parser.add_argument(
        "--cache-store-mib", type=int, default=None, help="memory the store's holder lends, in MiB (default: 256)"
    )
    parser.add_argument(
        "--openai-door",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also start the OpenAI-compatible HTTP door in front of the router (default: on)",
    )
    parser.add_argument(
        "--door-placement",
        choices=DOOR_PLACEMENTS,
        default=None,
        help="where the OpenAI door runs: router (in the router's process, its --openai-port: one process and "
        "one relay per token less; e+pd and e/p/d) or process (its own, services/openai_door); default: router, "
        "process in the colocated layout",
    )
    parser.add_argument(
        "--placement",
        action="store_true",
        help="e+pd or e/p/d on vLLM on a small host: the decoding engine (the PD's, the decode's) alone on the last "
        "CPU, the other services on the rest, the encoders at nice 19, the router admitting a few decoding batches "
        "(libs/launch/placement.py)",
    )
    parser.add_argument(
        "--tls",
        action="store_true",
        default=None,
        help="throwaway CA and certificates: services talk mutual TLS; clients need RUN_DIR/tls/ca.pem and the "
        "bearer token in RUN_DIR/tls/client.token (epd generate finds both)",
    )


# Flags a stack description sets; given beside --config they would contradict the file.
_DESCRIBED = (
    "layout",
    "encoders",
    "engine",
    "encoder_engine",
    "model",
    "cache_store",
    "cache_store_mib",
    "tls",
    "door_placement",
)


def _described_spec(ns: argparse.Namespace, env: dict[str, str]) -> StackSpec:
    given = [f"--{name.replace('_', '-')}" for name in _DESCRIBED if getattr(ns, name) is not None]
    if ns.placement:
        raise SystemExit("epd: --placement cannot be combined with --config (a description places nothing)")
    if given:
        raise SystemExit(f"epd: {', '.join(given)} cannot be combined with --config: set it in {ns.config}")
    try:
        plan = stack_spec(load_description(ns.config), run_dir=ns.run_dir, env=env)
    except DescriptionError as exc:
        raise SystemExit(f"epd: {exc}") from None
    for note in plan.notes:
        print(f"epd: {note}", file=sys.stderr)
    spec = plan.spec
    return dataclasses.replace(
        spec,
        model=ensure_model(spec.model),
        ready_timeout_s=420.0 if "vllm" in (spec.engine, spec.encoder_engine) else 120.0,
        openai_door=spec.openai_door and ns.openai_door,
    )


def _door_placement(ns: argparse.Namespace, layout: str) -> str:
    if ns.door_placement == DOOR_IN_ROUTER and layout == "colocated":
        raise SystemExit("epd: --door-placement router needs a router (the e+pd or e/p/d layout), not colocated")
    return str(ns.door_placement or default_door_placement(layout))


def start_run(ns: argparse.Namespace, spec: StackSpec) -> tuple[StackSpec, runs.Run]:
    """A new run of the stack in RUN_DIR (which the caller holds): the stack's logs go to the run's
    directory, its spans to the run's span file (or --trace-file)."""
    run = runs.start(ns.run_dir, ns.trace_file, spans=ns.trace_exporter == "jsonl")
    env = dict(spec.env)
    if run.trace_file is not None:
        env["EPD_TRACE_FILE"] = str(run.trace_file)
    return dataclasses.replace(spec, env=env, log_dir=run.dir), run


def _spec(ns: argparse.Namespace) -> StackSpec:
    env = {
        "EPD_TRACE_EXPORTER": ns.trace_exporter,
        "EPD_OTLP_ENDPOINT": ns.otlp_endpoint,
        "EPD_WARM_UP": "true",  # the router's first contact with every backend before traffic
    }
    if ns.config is not None:
        return _described_spec(ns, env)
    layout = ns.layout or "e/p/d"
    engine = ns.engine or "reference"
    if engine == "vllm" and layout == "colocated":
        raise SystemExit("epd: --engine vllm serves the e+pd or e/p/d layout, not colocated")
    encoder_engine = ns.encoder_engine or "reference"
    if encoder_engine == "vllm" and layout == "colocated":
        raise SystemExit("epd: --encoder-engine vllm runs in the e+pd or e/p/d layout, not colocated")
    model = ensure_model(ns.model or DEFAULT_MODEL)
    if (why := refusal(engine, model_type(model), layout)) is not None:
        raise SystemExit(f"epd: {why}")
    if encoder_engine == "vllm" and (why := encoder_refusal(model)) is not None:
        raise SystemExit(f"epd: {why}")
    if ns.placement:
        if engine != "vllm":
            raise SystemExit("epd: --placement is planned for --engine vllm (e+pd or e/p/d) only")
        try:
            Placement.for_host(layout=layout)  # the plan's own checks: the layout, enough CPUs
        except ValueError as exc:
            raise SystemExit(f"epd: --placement: {exc}") from None
    return StackSpec(
        layout=layout,
        encoders=2 if ns.encoders is None else ns.encoders,
        model=model,
        run_dir=ns.run_dir,
        env=env,
        cache_store=bool(ns.cache_store),
        cache_store_mib=256 if ns.cache_store_mib is None else ns.cache_store_mib,
        tls=bool(ns.tls),
        engine=engine,
        encoder_engine=encoder_engine,
        ready_timeout_s=420.0 if "vllm" in (engine, encoder_engine) else 120.0,
        openai_door=ns.openai_door,
        door_placement=_door_placement(ns, layout),
        placement=ns.placement,
    )


def cmd_up(ns: argparse.Namespace) -> int:
    from libs.cli.up import run_up

    try:
        lock = rundir.acquire(ns.run_dir)  # before anything slow: a second stack here is refused at once
    except rundir.RunDirInUse as exc:
        print(f"epd up: {exc}", file=sys.stderr)
        return 1
    if lock.note:
        print(f"epd up: {lock.note}", file=sys.stderr)
    try:
        spec, run = start_run(ns, _spec(ns))
        stack = Stack(dataclasses.replace(spec, fixed_ports=ns.supervise))
    except BaseException:
        lock.release()
        raise
    return run_up(stack, lock, ns.supervise, run)


def _sampling(ns: argparse.Namespace) -> sampling_pb2.SamplingParams:
    params = sampling_pb2.SamplingParams(
        temperature=ns.temperature, top_k=ns.top_k, max_tokens=ns.max_tokens, stop=ns.stop or []
    )
    if ns.top_p is not None:
        params.top_p = ns.top_p
    if ns.seed is not None:
        params.seed = ns.seed
    return params


def cmd_generate(ns: argparse.Namespace) -> int:
    try:
        target = router_target(ns)
    except UsageError as exc:
        print(f"epd generate: {exc}", file=sys.stderr)
        return 2
    files = [(p, media_pb2.MODALITY_IMAGE) for p in ns.image or []]
    files += [(p, media_pb2.MODALITY_VIDEO) for p in ns.video or []]
    files += [(p, media_pb2.MODALITY_AUDIO) for p in ns.audio or []]
    missing = [str(p) for p, _ in files if not p.is_file()]
    if missing:
        print(f"epd generate: no such file: {', '.join(missing)}", file=sys.stderr)
        return 2
    media = [media_from_file(p, modality) for p, modality in files]
    request = build_request(ns.prompt, media, sampling=_sampling(ns))
    return stream_to_stdout("epd generate", target, request, ns.timeout, first="ttft", hint=_speech_hint)


def _speech_hint(stack: Served | None, exc: grpc.aio.AioRpcError) -> str | None:
    """A speech model refuses chat (INVALID_ARGUMENT: it takes no text prompt); name the command it takes."""
    if stack is None or not stack.speech or exc.code() != grpc.StatusCode.INVALID_ARGUMENT:
        return None
    return f"the stack serves {stack.model or 'a speech model'}, a speech model: use `epd transcribe FILE`"


def cmd_demo(ns: argparse.Namespace) -> int:
    from libs.cli.demo import run_demo

    try:
        lock = rundir.acquire(ns.run_dir)  # its logs would mix with a running stack's
    except rundir.RunDirInUse as exc:
        print(f"epd demo: {exc}", file=sys.stderr)
        return 1
    try:
        spec, run = start_run(ns, _spec(ns))
        return run_demo(spec, trace_file=run.trace_file)
    finally:
        lock.release()


def build_parser() -> argparse.ArgumentParser:
    parser = EpdParser(prog="epd", description="EPD: disaggregated multimodal LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start a stack on loopback until Ctrl-C")
    _stack_args(up)
    up.add_argument(
        "--supervise",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="restart a service that dies, with back-off, on its own port (default: on)",
    )
    up.set_defaults(func=cmd_up)

    gen = sub.add_parser("generate", help="send one request to a router and stream the reply")
    gen.add_argument("prompt", help="the user turn's text (after the media)")
    gen.add_argument("--address", default="", help=f"router address (default: RUN_DIR/{ADDRESS_FILE})")
    gen.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR, help="where `epd up` runs (address, tls/)")
    gen.add_argument("--tls-ca", type=Path, default=None, help="CA of the router's certificate (PEM): use TLS")
    gen.add_argument("--token-file", type=Path, default=None, help="bearer token file (or env EPD_TOKEN)")
    gen.add_argument("--image", type=Path, action="append", help="image file (repeatable)")
    gen.add_argument("--video", type=Path, action="append", help="video file (repeatable)")
    gen.add_argument("--audio", type=Path, action="append", help="audio file (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument(
        "--top-p",
        type=float,
        default=None,
        help="nucleus sampling: keep the likeliest tokens up to this mass (unset: 1, off)",
    )
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    gen.add_argument(
        "--seed", type=int, default=None, help="seed of the sampler, for a repeatable sample (unset: random)"
    )
    gen.add_argument("--stop", action="append", help="stop sequence (repeatable)")
    gen.add_argument("--timeout", type=float, default=120.0, help="deadline in seconds")
    gen.set_defaults(func=cmd_generate)

    trace = sub.add_parser("trace", help="trace tools").add_subparsers(dest="trace_command", required=True)
    from libs.cli import trace as trace_command  # epd trace report

    trace_command.add_parser(trace)

    demo = sub.add_parser("demo", help="start a stack, send sample requests, print outputs and timings, stop")
    _stack_args(demo)
    demo.set_defaults(func=cmd_demo)

    from libs.cli import deploy  # epd deploy render (Kubernetes manifests)

    deploy.add_parser(sub)

    from libs.cli import speech_demo, transcribe  # speech through a Whisper stack

    transcribe.add_parser(sub)
    speech_demo.add_parser(sub)

    from libs.cli import bench, plan  # load generation and capacity planning (libs/bench)

    bench.add_parser(sub)
    plan.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    ns = build_parser().parse_args(argv)
    sys.exit(ns.func(ns))
