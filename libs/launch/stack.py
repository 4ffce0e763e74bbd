"""A whole EPD stack on loopback, one process per service, in one of three layouts:

- colocated: one `services.colocated` process (serves Generate itself);
- e+pd: N encoders + M prefill-decode services + the router;
- e/p/d: N encoders + M prefills + K decodes + the router.

Encoders are named `encoder-i`; one prefill, decode or pd is named after its role, several
`prefill-i` (and so on). The router gets every member's address (`--prefill A,B`).

Back ends start in parallel (each loads its half of the model); the router starts once their
addresses are known. `down()` stops the router first, then the rest, each by its PID.

With `tls`, the launcher makes a throwaway CA (`libs/rpc/certs.py`) and a certificate per process
under `<run_dir>/tls/`: services talk mutual TLS, and clients need the CA (`ca.pem`) and the bearer
token in `client.token` to call the router (or the colocated service).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from libs.backends.engines import encoder_refusal, model_type, refusal
from libs.launch.placement import DECODING_ROLE, Placement
from libs.launch.process import LaunchError, ServiceProcess, free_port
from libs.launch.store import StoreProcesses, start_store
from libs.rpc.certs import LocalCa, write_material

TLS_DIR = "tls"
CLIENT_TOKEN = "client.token"

LAYOUTS = ("colocated", "e+pd", "e/p/d")
# Where the OpenAI door runs: in the router's process, or in a process of its own.
DOOR_IN_ROUTER = "router"
DOOR_PROCESS = "process"
DOOR_PLACEMENTS = (DOOR_IN_ROUTER, DOOR_PROCESS)


def default_door_placement(layout: str) -> str:
    """Where the door runs unless told (`epd up`, stack descriptions, the benchmarks): in the
    router's process, which spares every token a relay through a third process
    (docs/openai-door.md); the colocated layout has no router, so there it is a process."""
    return DOOR_PROCESS if layout == "colocated" else DOOR_IN_ROUTER


@dataclass
class StackSpec:
    """What to launch."""

    layout: str = "e/p/d"
    encoders: int = 2
    prefills: int = 1  # e/p/d
    decodes: int = 1  # e/p/d
    pds: int = 1  # e+pd
    model: Path = Path("var/models/qwen2_5_omni-tiny")
    run_dir: Path = Path("var/run/stack")
    # Where the services' logs go (and the store's, under store/); None: run_dir. A launcher gives
    # each run a directory of its own (libs/launch/runs.py).
    log_dir: Path | None = None
    torch_threads: int = 1
    # Registered pool per model service, in MiB: committed memory, so keep it to what the model
    # needs (the tiny checkpoint moves kilobytes; the services' own defaults suit real models).
    pool_mib: int = 64
    # Start a Mooncake Store (master + storage holder); every encoder caches in it and the router
    # looks items up in it before dispatching.
    cache_store: bool = False
    cache_store_mib: int = 256  # memory the holder lends the store, in MiB
    # Mutual TLS between services and a bearer token for clients (files under run_dir/tls).
    tls: bool = False
    # Each service on a port chosen at launch (not 0), so a restarted process is found where its
    # peers look: what a supervisor (libs/launch/supervisor.py) needs.
    fixed_ports: bool = False
    # Engine of the language-model services (pd, or prefill and decode): "reference" (the
    # project's runtime) or "vllm" (slower to start and heavier per service).
    engine: str = "reference"
    # Engine of the encoders: "reference" or "vllm" (encoder-only, writing into the encoder's pool;
    # Qwen2.5-VL and Qwen3-VL). Any pair whose embedding contract matches is allowed; the LM
    # services check it at first contact.
    encoder_engine: str = "reference"
    env: dict[str, str] = field(default_factory=dict)  # extra environment for every service (EPD_*)
    extra_args: dict[str, list[str]] = field(default_factory=dict)  # per service name
    # Per service name, a module (and its arguments) the service is run through, as
    # `python -m WRAPPER ARGS... MODULE SERVICE_ARGS...`: a test harness that forces a fault inside
    # an unchanged service (tests/support/gated.py holds a service's work at gates a test opens).
    run_through: dict[str, list[str]] = field(default_factory=dict)
    ready_timeout_s: float = 120.0
    # The OpenAI-compatible HTTP door (libs/door) in front of the router (or the colocated
    # service); `Stack.door_url` is its base URL.
    openai_door: bool = False
    # Where the door runs: "router" (the router's own process, `--openai-port`), "process" (its
    # own, services/openai_door); empty: `default_door_placement(layout)`.
    door_placement: str = ""
    # E+PD or E/P/D on vLLM: the decoding engine (the PD's, the decode's) alone on a CPU, the encoders
    # at the lowest priority, the router admitting a few batches (libs/launch/placement.py); 2 CPUs or more.
    placement: bool = False


def replica_names(role: str, replicas: int) -> list[str]:
    """Process names of a pooled role's replicas: encoders always numbered, others when several."""
    if replicas == 1 and role != "encoder":
        return [role]
    return [f"{role}-{i}" for i in range(replicas)]


class Stack:
    """A launched stack; use `up()` / `down()` or the `running` context manager."""

    def __init__(self, spec: StackSpec) -> None:
        if spec.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {spec.layout!r}; expected one of {', '.join(LAYOUTS)}")
        if spec.layout != "colocated" and spec.encoders < 1:
            raise ValueError("a disaggregated layout needs at least one encoder")
        if min(spec.prefills, spec.decodes, spec.pds) < 1:
            raise ValueError("prefills, decodes and pds must be at least 1")
        if spec.engine not in ("reference", "vllm"):
            raise ValueError(f"unknown engine {spec.engine!r}; expected reference or vllm")
        if spec.placement and (spec.layout not in DECODING_ROLE or spec.engine != "vllm"):
            raise ValueError("placement is planned for E+PD and E/P/D on vLLM (engine vllm) only")
        if spec.placement and (spec.pds if spec.layout == "e+pd" else spec.decodes) > 1:
            raise ValueError("placement plans one decoding engine (one CPU of its own); several would share it")
        if spec.encoder_engine not in ("reference", "vllm"):
            raise ValueError(f"unknown encoder engine {spec.encoder_engine!r}; expected reference or vllm")
        if spec.encoder_engine == "vllm" and spec.layout == "colocated":
            raise ValueError("a vLLM encoder runs in a disaggregated layout (e+pd, e/p/d), not colocated")
        if spec.encoder_engine == "vllm" and (why := encoder_refusal(spec.model)) is not None:
            raise ValueError(why)
        if spec.door_placement not in ("", *DOOR_PLACEMENTS):
            raise ValueError(f"unknown door placement {spec.door_placement!r}; expected router or process")
        if spec.door_placement == DOOR_IN_ROUTER and spec.layout == "colocated":
            raise ValueError(
                "the colocated layout has no router to serve the door: door placement router needs e+pd or e/p/d"
            )
        if spec.engine == "vllm" and spec.layout == "colocated":
            raise ValueError("the vLLM engine serves PD (E+PD) or prefill and decode (E/P/D), not the colocated layout")
        if (why := refusal(spec.engine, model_type(spec.model), spec.layout)) is not None:
            raise ValueError(why)
        self.placement = Placement.for_host(layout=spec.layout) if spec.placement else None
        self.door_placement = spec.door_placement or default_door_placement(spec.layout)
        self.spec = spec
        self.processes: dict[str, ServiceProcess] = {}
        self.address = ""
        self.door_url = ""  # http(s)://HOST:PORT/v1 of the OpenAI door, when it runs
        self.store: StoreProcesses | None = None
        self._ca: LocalCa | None = None
        self._ports: set[int] = set()

    @property
    def log_dir(self) -> Path:
        return self.spec.log_dir or self.spec.run_dir

    @property
    def tls_dir(self) -> Path:
        return self.spec.run_dir / TLS_DIR

    def _security_args(self, name: str, module: str) -> list[str]:
        """A certificate for the process (CN epd-<role>); public servers also get the client token."""
        if self._ca is None:
            return []
        role = module.rsplit(".", 1)[-1]
        ca, cert, key = write_material(self._ca.issue(role), self.tls_dir, name)
        args = ["--tls-ca", str(ca), "--tls-cert", str(cert), "--tls-key", str(key)]
        if role in ("router", "colocated", "openai_door"):
            args += ["--auth-tokens-file", str(self.tls_dir / CLIENT_TOKEN)]
        return args

    def _port_args(self) -> list[str]:
        if not self.spec.fixed_ports:
            return []
        port = free_port()
        while port in self._ports:  # two free ports in a row can be the same one
            port = free_port()
        self._ports.add(port)
        return ["--port", str(port)]

    def _start_tls(self) -> None:
        self._ca = LocalCa.create()
        token = self.tls_dir / CLIENT_TOKEN
        self.tls_dir.mkdir(parents=True, exist_ok=True)
        token.touch(mode=0o600)
        token.write_text(secrets.token_urlsafe(32) + "\n")

    def _process(self, name: str, module: str, args: list[str]) -> ServiceProcess:
        spec = self.spec
        role = module.rsplit(".", 1)[-1]
        place = self.placement
        planned = [] if place is None else place.args(role)  # before the extra arguments: those win
        args = [*args, *planned, *self._port_args(), *self._security_args(name, module), *spec.extra_args.get(name, [])]
        if name in spec.run_through:
            wrapper, *wrapper_args = spec.run_through[name]
            module, args = wrapper, [*wrapper_args, module, *args]
        process = ServiceProcess(
            name=name,
            module=module,
            args=args,
            log_path=self.log_dir / f"{name}.log",
            env=spec.env,
            cpus=None if place is None else place.cpus(role),
            nice=0 if place is None else place.nice(role),
        )
        self.processes[name] = process
        return process

    def _engine_args(self) -> list[str]:
        # Only when not the default: older checkouts' services have no --engine flag.
        return [] if self.spec.engine == "reference" else ["--engine", self.spec.engine]

    def _model_args(self) -> list[str]:
        spec = self.spec
        return [
            "--model",
            str(spec.model),
            "--torch-threads",
            str(spec.torch_threads),
            "--pool-mib",
            str(spec.pool_mib),
        ]

    def up(self) -> str:
        """Start every service; returns the address clients call Generate on."""
        spec = self.spec
        started = time.monotonic()
        try:
            if spec.tls:
                self._start_tls()
            if spec.layout == "colocated":
                colocated = self._process("colocated", "services.colocated", self._model_args())
                colocated.start()
                self.address = colocated.wait_ready(spec.ready_timeout_s)
                self._start_door(spec.ready_timeout_s)
                return self.address
            encoder_args = self._model_args()
            if spec.encoder_engine != "reference":  # older checkouts' encoders have no --engine flag
                encoder_args += ["--engine", spec.encoder_engine]
            if spec.cache_store:
                self.store = start_store(self.log_dir / "store", segment_size=spec.cache_store_mib << 20)
                encoder_args += ["--cache-master", self.store.master_address]
            encoders = [self._process(f"encoder-{i}", "services.encoder", encoder_args) for i in range(spec.encoders)]
            lm_args = [*self._model_args(), *self._engine_args()]  # the language-model services
            if spec.layout == "e/p/d":
                prefills = [
                    self._process(n, "services.prefill", lm_args) for n in replica_names("prefill", spec.prefills)
                ]
                decodes = [self._process(n, "services.decode", lm_args) for n in replica_names("decode", spec.decodes)]
                backends = [*prefills, *decodes]
            else:
                backends = [self._process(n, "services.pd", lm_args) for n in replica_names("pd", spec.pds)]
            for process in [*encoders, *backends]:
                process.start()
            remaining = spec.ready_timeout_s
            for process in [*encoders, *backends]:
                process.wait_ready(max(1.0, remaining - (time.monotonic() - started)))
            router_args = ["--layout", spec.layout, "--encoders", ",".join(p.address for p in encoders)]
            if spec.layout == "e/p/d":
                router_args += ["--prefill", ",".join(p.address for p in prefills)]
                router_args += ["--decode", ",".join(p.address for p in decodes)]
            else:
                router_args += ["--pd", ",".join(p.address for p in backends)]
            if self.store is not None:
                router_args += ["--cache-master", self.store.master_address]
            in_router = spec.openai_door and self.door_placement == DOOR_IN_ROUTER
            if in_router:
                port = self._port_args()[1] if spec.fixed_ports else "0"
                router_args += ["--openai-port", port, "--model", str(spec.model)]
            router = self._process("router", "services.router", router_args)
            router.start()
            self.address = router.wait_ready(max(1.0, remaining - (time.monotonic() - started)))
            if in_router:
                door = router.wait_ready(max(1.0, remaining - (time.monotonic() - started)), listener="openai_door")
                self.door_url = self._door_url(door)
            else:
                self._start_door(max(1.0, remaining - (time.monotonic() - started)))
            return self.address
        except BaseException:
            self.down()
            raise

    def _start_door(self, timeout_s: float) -> None:
        if not self.spec.openai_door:
            return
        args = ["--router", self.address, "--model", str(self.spec.model)]
        door = self._process("openai_door", "services.openai_door", args)
        door.start()
        self.door_url = self._door_url(door.wait_ready(timeout_s))

    def _door_url(self, address: str) -> str:
        return f"{'https' if self.spec.tls else 'http'}://{address}/v1"

    def down(self, on_stopped: Callable[[str, int | None], None] | None = None) -> dict[str, int | None]:
        """Stop the front doors first (no new work), then the back ends; returns exit statuses.
        `on_stopped(name, status)` hears of each as it exits (each drains first, up to its grace
        period: a launcher shows progress rather than seconds of silence)."""
        order = sorted(self.processes, key=lambda n: {"openai_door": 0, "router": 1}.get(n, 2))
        statuses: dict[str, int | None] = {}
        for name in order:
            statuses[name] = self.processes[name].stop()
            if on_stopped is not None:
                on_stopped(name, statuses[name])
        if self.store is not None:
            self.store.stop()
            self.store = None
        return statuses

    def kill(self) -> dict[str, int | None]:
        """SIGKILL every process at once (no drain: a user who will not wait); returns exit statuses."""
        for process in self.processes.values():
            process.kill()
        if self.store is not None:
            self.store.stop()
            self.store = None
        return {name: p.process.returncode if p.process is not None else None for name, p in self.processes.items()}

    @contextmanager
    def running(self) -> Iterator[Stack]:
        self.up()
        try:
            yield self
        finally:
            self.down()


__all__ = [
    "DOOR_IN_ROUTER",
    "DOOR_PLACEMENTS",
    "DOOR_PROCESS",
    "LAYOUTS",
    "LaunchError",
    "Stack",
    "StackSpec",
    "default_door_placement",
    "replica_names",
]
