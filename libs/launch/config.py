"""The declarative stack description (deploy/stacks/*.yaml, schema deploy/schema/stack.schema.json).

One file says what a stack is: layout, roles and replicas (and, in any layout, the OpenAI door),
model, ports, transport, cache, TLS, drain. `load_description` validates it against the JSON
Schema (a bad file fails with a `DescriptionError` naming the file and the offending key, e.g.
`roles.encoder.replicas`), fills the schema's defaults and checks what a schema cannot (the roles
a layout needs, autoscale bounds). The same `StackDescription` becomes a local `StackSpec` (`stack_spec`, what
`epd up --config` runs) and Kubernetes manifests (`libs/launch/k8s.py`), so the two cannot drift.
Settings reach a service as its own `EPD_*` settings (`role_settings`), never anything else.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from libs.backends.engines import encoder_refusal, model_type, refusal
from libs.launch.process import ROOT
from libs.launch.stack import DOOR_IN_ROUTER, DOOR_PROCESS, StackSpec, default_door_placement, replica_names

SCHEMA_PATH = ROOT / "deploy" / "schema" / "stack.schema.json"
# The roles each layout runs (and no others).
LAYOUT_ROLES = {
    "colocated": ("colocated",),
    "e+pd": ("router", "encoder", "pd"),
    "e/p/d": ("router", "encoder", "prefill", "decode"),
}
# The OpenAI-compatible HTTP door (libs/door): optional in every layout, in front of the router (or
# the colocated service), in the router's process or in one of its own (`placement`).
DOOR = "openai_door"
# What only a door process of its own has: with placement router the router's count, resources,
# deadline and log level apply.
_PROCESS_ONLY = ("replicas", "cpu", "memory")
_PROCESS_ONLY_SETTINGS = {"request_timeout_s": "max_request_s", "log_level": "log_level"}
# gRPC port of each role when the description gives none (Kubernetes; one role per pod).
DEFAULT_PORTS = {
    "router": 50051,
    "colocated": 50051,
    "encoder": 50061,
    "prefill": 50071,
    "pd": 50071,
    "decode": 50081,
    DOOR: 8000,
}
MODEL_ROLES = ("encoder", "prefill", "decode", "pd", "colocated")
# Roles the router keeps a pool of (--encoders, --prefill, --decode, --pd: every replica is a member).
POOLED = ("encoder", "prefill", "decode", "pd")
# `epd up` runs every replica of a pooled role on this host; of the stateless front-ends it runs one
# (on one host a second router adds nothing, and nothing balances colocated replicas).
LOCAL_ONE_OF = ("router", "colocated", DOOR)

Value = str | int | float | bool


class DescriptionError(ValueError):
    """A stack description that cannot be used; the message names the file and the key."""


@dataclass(frozen=True)
class Autoscale:
    min_replicas: int
    max_replicas: int
    target_occupancy: float


@dataclass(frozen=True)
class Role:
    name: str
    replicas: int
    port: int
    cpu: str
    memory: str
    autoscale: Autoscale | None
    settings: Mapping[str, Value]


@dataclass(frozen=True)
class StackDescription:
    """A validated description with every default filled in (`raw` keeps the whole document)."""

    source: Path
    raw: Mapping[str, Any]
    roles: Mapping[str, Role] = field(default_factory=dict)

    def __getitem__(self, section: str) -> Any:
        return self.raw[section]

    @property
    def name(self) -> str:
        return str(self.raw["name"])

    @property
    def layout(self) -> str:
        return str(self.raw["layout"])

    @property
    def store_enabled(self) -> bool:
        return bool(self.raw["cache"]["store"]["enabled"]) and self.layout != "colocated"

    @property
    def tls(self) -> bool:
        return bool(self.raw["tls"]["enabled"])

    @property
    def door_placement(self) -> str | None:
        """Where the door runs ("router", "process"), or None without a door."""
        return door_placement(self.raw)

    @property
    def door_in_router(self) -> bool:
        return self.door_placement == DOOR_IN_ROUTER


def door_placement(doc: Mapping[str, Any]) -> str | None:
    """The description's door placement, its layout's default when it gives none; None: no door."""
    door = doc["roles"].get(DOOR)
    if door is None:
        return None
    return str(door.get("placement") or default_door_placement(doc["layout"]))


@cache
def schema() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(SCHEMA_PATH.read_text())
    jsonschema.Draft202012Validator.check_schema(loaded)
    return loaded


def _key(path: Any) -> str:
    """`roles.encoder.replicas` from a jsonschema error path."""
    return ".".join(str(p) for p in path) or "(top level)"


def _message(error: jsonschema.ValidationError) -> str:
    """One line naming the key and the problem."""
    where = _key(error.absolute_path)
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        allowed = sorted(error.schema.get("properties", {}))
        extra = sorted(set(error.instance) - set(allowed))
        keys = ", ".join(f"{where}.{k}" if error.absolute_path else k for k in extra)
        return f"{keys}: unknown key (allowed here: {', '.join(allowed)})"
    if "propertyNames" in error.absolute_schema_path:
        # jsonschema reports the key itself as the instance, at the path of the object holding it.
        names = ", ".join(error.validator_value)
        return f"{where}.{error.instance}: not a setting this role takes here (allowed: {names})"
    return f"{where}: {error.message}"


def _errors(document: Any) -> list[str]:
    validator = jsonschema.Draft202012Validator(schema())
    errors = sorted(validator.iter_errors(document), key=lambda e: list(map(str, e.absolute_path)))
    return [_message(error) for error in errors]


def _resolve(node: Mapping[str, Any]) -> Mapping[str, Any]:
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/$defs/"):
        target: Mapping[str, Any] = schema()["$defs"][ref.removeprefix("#/$defs/")]
        return {**target, **{k: v for k, v in node.items() if k != "$ref"}, "properties": _properties(node, target)}
    return node


def _properties(node: Mapping[str, Any], target: Mapping[str, Any]) -> dict[str, Any]:
    return {**target.get("properties", {}), **node.get("properties", {})}


def _with_defaults(instance: dict[str, Any], node: Mapping[str, Any]) -> dict[str, Any]:
    """`instance` with the schema's defaults filled in, recursively (objects only)."""
    node = _resolve(node)
    out = dict(instance)
    for name, sub in node.get("properties", {}).items():
        sub = _resolve(sub)
        if name not in out and "default" in sub:
            out[name] = sub["default"]
        if sub.get("type") == "object" and "properties" in sub:
            # Sections are filled in; an optional block with required keys (autoscale) stays absent.
            if name not in out and not sub.get("required") and node is not schema()["properties"]["roles"]:
                out[name] = {}
            if isinstance(out.get(name), dict):
                out[name] = _with_defaults(out[name], sub)
    return out


def _semantic_problems(doc: Mapping[str, Any]) -> list[str]:
    layout, roles = doc["layout"], doc["roles"]
    wanted = LAYOUT_ROLES[layout]
    problems = [f"roles.{r}: layout {layout} needs this role" for r in wanted if r not in roles]
    problems += [
        f"roles.{r}: layout {layout} has no such role (it runs {', '.join(wanted)}, and optionally {DOOR})"
        for r in roles
        if r not in wanted and r != DOOR
    ]
    if doc.get("engine") == "vllm" and layout == "colocated":
        problems.append("engine: vllm serves the PD service (e+pd) or prefill and decode (e/p/d); layout is colocated")
    path = doc.get("model", {}).get("path")
    if path and (why := refusal(str(doc.get("engine", "reference")), model_type(Path(path)), layout)) is not None:
        problems.append(f"engine: {why} (model.path {path})")
    if doc.get("encoder_engine") == "vllm":
        if layout == "colocated":
            problems.append("encoder_engine: a vLLM encoder runs in e+pd or e/p/d; layout is colocated")
        elif path and (why := encoder_refusal(Path(path))) is not None:
            problems.append(f"encoder_engine: {why} (model.path {path})")
    for name, role in roles.items():
        scale = role.get("autoscale")
        if scale is None:
            continue
        if name != "encoder":
            problems.append(f"roles.{name}.autoscale: only the encoder pool autoscales")
        low = scale.get("min_replicas", role.get("replicas", 1))
        if low > scale["max_replicas"]:
            problems.append(f"roles.{name}.autoscale: min_replicas {low} > max_replicas {scale['max_replicas']}")
    telemetry = doc.get("telemetry", {})
    for name, role in roles.items():
        if name == DOOR:
            continue  # it serves health and metrics on its HTTP port and binds no telemetry ports
        port = role.get("port", DEFAULT_PORTS[name])
        for other in ("metrics_port", "health_port"):
            if port == telemetry.get(other, schema()["properties"]["telemetry"]["properties"][other]["default"]):
                problems.append(f"roles.{name}.port: {port} is also telemetry.{other}")
    return problems + _door_problems(doc)


def _door_problems(doc: Mapping[str, Any]) -> list[str]:
    """A door in the router's process: there is a router, and the description gives nothing that
    only a process of its own would have; its HTTP port is one more port of the router's pods."""
    placement = door_placement(doc)
    if placement is None or placement == DOOR_PROCESS:
        return []
    if doc["layout"] == "colocated":
        return [f"roles.{DOOR}.placement: router needs a router (layout e+pd or e/p/d); layout is colocated"]
    door, why = doc["roles"][DOOR], "the door runs in the router's process (placement router)"
    problems = [f"roles.{DOOR}.{key}: {why}: the router's {key} apply" for key in _PROCESS_ONLY if key in door]
    problems += [
        f"roles.{DOOR}.settings.{key}: {why}: roles.router.settings.{router_key} applies"
        for key, router_key in _PROCESS_ONLY_SETTINGS.items()
        if key in door.get("settings", {})
    ]
    if "openai_door_service_type" in doc.get("kubernetes", {}):
        problems.append(f"kubernetes.openai_door_service_type: {why}: its port is on the router's Service "
                        "(kubernetes.router_service_type)")  # fmt: skip
    port = door.get("port", DEFAULT_PORTS[DOOR])
    telemetry = doc.get("telemetry", {})
    taken = {"roles.router.port": doc["roles"]["router"].get("port", DEFAULT_PORTS["router"])}
    for other in ("metrics_port", "health_port"):
        taken[f"telemetry.{other}"] = telemetry.get(
            other, schema()["properties"]["telemetry"]["properties"][other]["default"]
        )
    problems += [f"roles.{DOOR}.port: {port} is also {key} ({why})" for key, value in taken.items() if value == port]
    return problems


def default_namespace(name: str) -> str:
    """The Kubernetes namespace of a stack whose description names none."""
    return f"epd-{name}"


def parse_description(document: Any, source: Path) -> StackDescription:
    """Validate a parsed document; raises DescriptionError listing every problem by key."""
    if not isinstance(document, dict):
        raise DescriptionError(f"{source}: expected a mapping at the top level, got {type(document).__name__}")
    problems = _errors(document)
    if not problems:
        problems = _semantic_problems(document)
    if problems:
        raise DescriptionError(f"{source}: " + "; ".join(problems))
    doc = _with_defaults(document, schema())
    # Per stack: every stack's objects have the same names (epd-router, ...), so stacks that shared
    # a namespace would overwrite each other.
    doc["kubernetes"].setdefault("namespace", default_namespace(doc["name"]))
    roles = {}
    for name, role in doc["roles"].items():
        role = _with_defaults(role, schema()["properties"]["roles"]["properties"][name])
        scale = role.get("autoscale")
        roles[name] = Role(
            name=name,
            replicas=role["replicas"],
            port=role.get("port", DEFAULT_PORTS[name]),
            cpu=role["cpu"],
            memory=role["memory"],
            autoscale=None
            if scale is None
            else Autoscale(
                scale.get("min_replicas", role["replicas"]), scale["max_replicas"], scale["target_occupancy"]
            ),
            settings=dict(role.get("settings", {})),
        )
    return StackDescription(source=source, raw=doc, roles=roles)


def load_description(path: Path) -> StackDescription:
    """Read, validate and complete a stack description (YAML)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise DescriptionError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise DescriptionError(f"{path}: not valid YAML: {exc}") from None
    return parse_description(document, path)


def env_value(value: Value) -> str:
    """A setting's value as its environment variable spells it (libs/config reads true/false)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def env_name(setting: str) -> str:
    """The service's environment variable of a setting (libs/config: EPD_<NAME>)."""
    return "EPD_" + setting.upper()


def role_settings(desc: StackDescription, role: str) -> dict[str, Value]:
    """The settings (by setting name) the description gives one role, wherever it runs. Addresses,
    host, ports and TLS files depend on where it runs and are added by the local launcher or the
    Kubernetes renderer."""
    values: dict[str, Value] = {"grace_s": desc["drain"]["grace_s"]}
    if role in MODEL_ROLES:
        transport = desc["transport"]
        values |= {
            "model": desc["model"]["path"],
            "torch_threads": desc["model"]["torch_threads"],
            "pool_mib": transport["pool_mib"],
            "checksum": transport["checksums"],
            "poison_freed": transport["poison_freed"],
            "lease_ttl_s": transport["lease_ttl_s"],
        }
    if role == "encoder":
        values["cache_mib"] = desc["cache"]["local_mib"]
        if desc["encoder_engine"] != "reference":  # the default: older images' encoders lack --engine
            values["engine"] = desc["encoder_engine"]
    if role in ("pd", "prefill", "decode"):
        values["engine"] = desc["engine"]
    if role == "router":
        values["layout"] = desc.layout
        values["discovery_refresh_s"] = desc["discovery"]["refresh_s"]
    if role == DOOR or (role == "router" and desc.door_in_router):
        values["model"] = desc["model"]["path"]  # the id /v1/models lists; the door reads no weights
    if role == "router" and desc.door_in_router:
        values |= desc.roles[DOOR].settings  # the door's own, served by the router's process
    values |= desc.roles[role].settings
    return values


# Settings the local launcher (libs/launch/stack.py) passes itself; the description's values for
# them reach `StackSpec` fields instead of flags.
_LAUNCHER_OWNED = {"model", "torch_threads", "pool_mib", "engine", "layout"}


def _flags(settings: Mapping[str, Value]) -> list[str]:
    """Command-line flags of settings (booleans are --name / --no-name, libs/config)."""
    args = []
    for name, value in settings.items():
        if name in _LAUNCHER_OWNED:
            continue
        flag = name.replace("_", "-")
        if isinstance(value, bool):
            args.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            args += [f"--{flag}", str(value)]
    return args


@dataclass(frozen=True)
class LocalPlan:
    spec: StackSpec
    notes: tuple[str, ...]  # what runs differently on this host than in Kubernetes


def stack_spec(desc: StackDescription, *, run_dir: Path, env: Mapping[str, str] | None = None) -> LocalPlan:
    """The local stack (`epd up --config`): one process per role, and per replica of a pooled role
    (encoder, prefill, decode, pd: named `ROLE-i` when there are several), every service on
    loopback on a free port (the description's ports are per pod, for Kubernetes)."""
    notes = [
        f"roles.{name}.replicas is {role.replicas}: one {name} runs on this host"
        for name, role in desc.roles.items()
        if role.replicas > 1 and name in LOCAL_ONE_OF
    ]
    extra_args: dict[str, list[str]] = {}
    for name in desc.roles:
        if name == DOOR and desc.door_in_router:
            continue  # the router's flags carry its settings
        flags = _flags(role_settings(desc, name))
        if name in POOLED:
            for process in replica_names(name, desc.roles[name].replicas):
                extra_args[process] = list(flags)
        else:
            extra_args[name] = flags
    spec = StackSpec(
        layout=desc.layout,
        encoders=desc.roles["encoder"].replicas if "encoder" in desc.roles else 0,
        prefills=desc.roles["prefill"].replicas if "prefill" in desc.roles else 1,
        decodes=desc.roles["decode"].replicas if "decode" in desc.roles else 1,
        pds=desc.roles["pd"].replicas if "pd" in desc.roles else 1,
        model=Path(desc["model"]["path"]),
        run_dir=run_dir,
        torch_threads=desc["model"]["torch_threads"],
        pool_mib=desc["transport"]["pool_mib"],
        cache_store=desc.store_enabled,
        cache_store_mib=desc["cache"]["store"]["memory_mib"],
        tls=desc.tls,
        engine=desc["engine"],
        encoder_engine=desc["encoder_engine"],
        env=dict(env or {}),
        extra_args=extra_args,
        openai_door=DOOR in desc.roles,
        door_placement=desc.door_placement or "",
    )
    return LocalPlan(spec, tuple(notes))


__all__ = [
    "DOOR",
    "LAYOUT_ROLES",
    "DescriptionError",
    "LocalPlan",
    "Role",
    "StackDescription",
    "door_placement",
    "env_name",
    "env_value",
    "load_description",
    "parse_description",
    "role_settings",
    "stack_spec",
]
