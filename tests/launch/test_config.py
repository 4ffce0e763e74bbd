"""The stack description (deploy/stacks/*.yaml): schema validation with errors naming the key, the
settings it gives each role are real settings of that service (checked with the services' own
parsers), and `epd up --config` maps it onto the local launcher."""

from __future__ import annotations

import dataclasses
import io
import json
from contextlib import redirect_stderr
from pathlib import Path
from typing import Any

import pytest
import yaml

from libs.config.settings import load_settings
from libs.launch.config import (
    LAYOUT_ROLES,
    SCHEMA_PATH,
    DescriptionError,
    StackDescription,
    load_description,
    parse_description,
    role_settings,
    stack_spec,
)
from libs.launch.stack import DOOR_IN_ROUTER, DOOR_PLACEMENTS, DOOR_PROCESS, default_door_placement
from tests.support.service_settings import SETTINGS

STACKS = sorted((Path(__file__).resolve().parents[2] / "deploy" / "stacks").glob("*.yaml"))


def _fields(cls: type[Any]) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _minimal(**over: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "version": 1,
        "name": "t",
        "layout": "e/p/d",
        "roles": {"router": {}, "encoder": {"replicas": 2}, "prefill": {}, "decode": {}},
    }
    doc.update(over)
    return doc


def _error(doc: Any) -> str:
    with pytest.raises(DescriptionError) as info:
        parse_description(doc, Path("bad.yaml"))
    return str(info.value)


@pytest.mark.unit
def test_every_committed_description_loads_and_covers_the_three_layouts() -> None:
    layouts = {load_description(path).layout for path in STACKS}
    assert layouts == set(LAYOUT_ROLES)


@pytest.mark.unit
@pytest.mark.parametrize("path", STACKS, ids=lambda p: p.stem)
def test_the_settings_a_description_gives_are_real_settings_of_each_role(path: Path) -> None:
    desc = load_description(path)
    for role in desc.roles:
        values = role_settings(desc, role)
        unknown = set(values) - _fields(SETTINGS[role])
        assert not unknown, f"{path.name}: {role} has no setting {unknown}"


@pytest.mark.unit
def test_the_schema_offers_each_role_only_settings_it_has() -> None:
    """A door in the router's process takes its settings as the router's: they are the router's too."""
    schema = json.loads(SCHEMA_PATH.read_text())
    roles = schema["properties"]["roles"]["properties"]
    for role, node in roles.items():
        ref = node["properties"]["settings"]["$ref"].removeprefix("#/$defs/")
        offered = set(schema["$defs"][ref]["propertyNames"]["enum"])
        assert offered <= _fields(SETTINGS[role]), f"{role}: {offered - _fields(SETTINGS[role])}"
    in_router = set(schema["$defs"]["openai_door_settings"]["propertyNames"]["enum"]) - {"request_timeout_s"}
    assert in_router <= _fields(SETTINGS["router"]), in_router - _fields(SETTINGS["router"])


@pytest.mark.unit
@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda d: d["roles"]["encoder"].update(replicas=0), "roles.encoder.replicas: 0 is less than the minimum of 1"),
        (lambda d: d["roles"]["encoder"].update(replica=2), "roles.encoder.replica: unknown key"),
        (lambda d: d.update(transport={"pool_mib": "lots"}), "transport.pool_mib: 'lots' is not of type 'integer'"),
        (lambda d: d.update(layout="e-p-d"), "layout: 'e-p-d' is not one of"),
        (lambda d: d["roles"].pop("decode"), "roles.decode: layout e/p/d needs this role"),
        (lambda d: d["roles"].update(pd={}), "roles.pd: layout e/p/d has no such role"),
        (
            lambda d: d["roles"]["encoder"].update(settings={"max_runing": 3}),
            "roles.encoder.settings.max_runing: not a setting this role takes here",
        ),
        (
            lambda d: d["roles"]["router"].update(settings={"cached_max_running": 3}),
            "roles.router.settings.cached_max_running: not a setting",
        ),
        (
            lambda d: d["roles"]["encoder"].update(autoscale={"min_replicas": 4, "max_replicas": 2}),
            "roles.encoder.autoscale: min_replicas 4 > max_replicas 2",
        ),
        (lambda d: d["roles"]["prefill"].update(autoscale={"max_replicas": 2}), "only the encoder pool autoscales"),
        (lambda d: d.update(engine="vllm", layout="colocated", roles={"colocated": {}}), "engine: vllm serves the PD"),
        (lambda d: d["roles"]["router"].update(port=9090), "roles.router.port: 9090 is also telemetry.metrics_port"),
        (lambda d: d.update(tls={"enabled": "yes"}), "tls.enabled: 'yes' is not of type 'boolean'"),
        (lambda d: d.pop("layout"), "'layout' is a required property"),
        (lambda d: d["roles"]["router"].update(memory="2GB"), "roles.router.memory: '2GB' does not match"),
        (
            lambda d: d["roles"].update(openai_door={"settings": {"max_running": 3}}),
            "roles.openai_door.settings.max_running: not a setting this role takes here",
        ),
        (
            lambda d: d["roles"].update(openai_door={"settings": {"router": "elsewhere:1"}}),
            "roles.openai_door.settings.router: not a setting this role takes here",
        ),
        (lambda d: d["roles"].update(openai_door={"replica": 2}), "roles.openai_door.replica: unknown key"),
        (lambda d: d["roles"].update(openai_door={"port": 0}), "roles.openai_door.port: 0 is less than the minimum"),
        (lambda d: d["roles"].update(openai_doors={}), "roles.openai_doors: unknown key"),
    ],
)
def test_a_bad_description_names_the_file_and_the_key(change: Any, expected: str) -> None:
    doc = _minimal()
    change(doc)
    message = _error(doc)
    assert message.startswith("bad.yaml: ")
    assert expected in message


@pytest.mark.unit
def test_defaults_are_filled_from_the_schema() -> None:
    desc = parse_description(_minimal(), Path("x.yaml"))
    assert desc["transport"]["pool_mib"] == 64 and desc["transport"]["checksums"] is True
    assert desc["cache"]["store"] == {
        "enabled": False,
        "memory_mib": 256,
        "master_port": 50090,
        "metrics_port": 9003,
        "holder_port": 50091,
    }
    assert desc.roles["encoder"].port == 50061 and desc.roles["encoder"].autoscale is None
    assert desc.roles["router"].replicas == 1 and desc.roles["router"].memory == "2Gi"


@pytest.mark.unit
def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(DescriptionError, match="cannot read"):
        load_description(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("roles: [unclosed\n")
    with pytest.raises(DescriptionError, match="not valid YAML"):
        load_description(bad)
    bad.write_text("- a list\n")
    with pytest.raises(DescriptionError, match="expected a mapping at the top level"):
        load_description(bad)


def _parse_flags(role: str, args: list[str]) -> Any:
    return load_settings(SETTINGS[role], argv=args, env={})


@pytest.mark.unit
def test_the_local_plan_passes_each_setting_as_a_flag_its_service_parses(tmp_path: Path) -> None:
    doc = _minimal(transport={"checksums": False, "lease_ttl_s": 12.5}, drain={"grace_s": 7})
    doc["roles"]["encoder"]["settings"] = {"cached_max_running": 3, "accept_inline_tensors": True}
    doc["roles"]["router"]["settings"] = {"max_running": 9}
    plan = stack_spec(parse_description(doc, Path("x.yaml")), run_dir=tmp_path)
    spec = plan.spec
    assert (spec.layout, spec.encoders, spec.pool_mib, spec.cache_store, spec.tls) == ("e/p/d", 2, 64, False, False)
    assert set(spec.extra_args) == {"router", "encoder-0", "encoder-1", "prefill", "decode"}
    encoder = _parse_flags("encoder", spec.extra_args["encoder-1"])
    assert (encoder.checksum, encoder.lease_ttl_s, encoder.grace_s) == (False, 12.5, 7.0)
    assert (encoder.cached_max_running, encoder.accept_inline_tensors, encoder.cache_mib) == (3, True, 256)
    prefill = _parse_flags("prefill", spec.extra_args["prefill"])
    assert (prefill.checksum, prefill.poison_freed) == (False, True)
    router = _parse_flags("router", spec.extra_args["router"])
    assert (router.max_running, router.grace_s) == (9, 7.0)
    assert plan.notes == ()


@pytest.mark.unit
def test_prefill_and_decode_replicas_are_pools_locally_and_in_kubernetes(tmp_path: Path) -> None:
    from libs.launch.k8s import role_documents

    doc = _minimal()
    doc["roles"]["prefill"]["replicas"] = 2
    doc["roles"]["decode"]["replicas"] = 3
    desc = parse_description(doc, Path("x.yaml"))
    spec = stack_spec(desc, run_dir=tmp_path).spec
    assert (spec.prefills, spec.decodes) == (2, 3)
    assert {"prefill-0", "prefill-1", "decode-0", "decode-1", "decode-2"} <= set(spec.extra_args)
    assert "prefill" not in spec.extra_args
    for role, count in (("prefill", 2), ("decode", 3)):
        kinds = {d["kind"]: d for d in role_documents(desc, desc.roles[role])}
        assert kinds["Deployment"]["spec"]["replicas"] == count
        assert kinds["Service"]["spec"]["clusterIP"] == "None"  # headless: the router's dns:/// pool
        assert "PodDisruptionBudget" in kinds


@pytest.mark.unit
def test_the_local_plan_runs_one_front_end(tmp_path: Path) -> None:
    doc = _minimal()
    doc["roles"]["router"]["replicas"] = 3
    plan = stack_spec(parse_description(doc, Path("x.yaml")), run_dir=tmp_path)
    assert plan.notes == ("roles.router.replicas is 3: one router runs on this host",)


@pytest.mark.unit
def test_cli_refuses_flags_that_contradict_the_file() -> None:
    from libs.cli.main import main

    with pytest.raises(SystemExit) as info, redirect_stderr(io.StringIO()):
        main(["up", "--config", str(STACKS[0]), "--layout", "e+pd", "--tls"])
    assert str(info.value) == f"epd: --layout, --tls cannot be combined with --config: set it in {STACKS[0]}"


@pytest.mark.unit
def test_cli_reports_a_bad_file_by_key(tmp_path: Path) -> None:
    from libs.cli.main import main

    path = tmp_path / "s.yaml"
    doc = _minimal()
    doc["roles"]["encoder"]["replicas"] = -1
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(SystemExit) as info:
        main(["up", "--config", str(path)])
    assert str(info.value).startswith(f"epd: {path}: roles.encoder.replicas: -1 is less than the minimum of 1")


@pytest.mark.unit
def test_a_description_is_immutable() -> None:
    desc = parse_description(_minimal(), Path("x.yaml"))
    assert isinstance(desc, StackDescription)
    with pytest.raises(dataclasses.FrozenInstanceError):
        desc.roles = {}  # type: ignore[misc]


@pytest.mark.stack
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_epd_up_runs_a_description(tmp_path: Path) -> None:
    """`epd up --config` on a real E+PD stack: the description's settings reach the services (the
    encoder runs without checksums and advertises none), two PD replicas run and the router pools
    them, a request is served, and the description's OpenAI door runs where the description leaves
    it by default, in the router's process, with its own settings."""
    import json as _json
    import os
    import re
    import signal
    import subprocess
    import sys
    import time
    import urllib.request

    import grpc

    from libs.contract.epd.v1 import service_info_pb2, service_info_pb2_grpc
    from libs.model.checkpoints import ensure_checkpoint

    model = ensure_checkpoint("qwen2_5_omni", "tiny")
    doc = {
        "version": 1,
        "name": "t",
        "layout": "e+pd",
        "model": {"path": str(model)},
        "roles": {
            "router": {},
            "encoder": {"settings": {"cached_max_running": 2}},
            "pd": {"replicas": 2},
            "openai_door": {"settings": {"served_model_name": "omni-tiny"}},
        },
        "transport": {"checksums": False, "pool_mib": 32},
        "drain": {"grace_s": 5},
    }
    config = tmp_path / "stack.yaml"
    config.write_text(yaml.safe_dump(doc))
    run_dir = tmp_path / "run"
    epd = [sys.executable, "-m", "libs.cli"]
    up = subprocess.Popen(
        [*epd, "up", "--config", str(config), "--run-dir", str(run_dir), "--no-supervise", "--trace-exporter", "none"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        address_file = run_dir / "router.address"
        deadline = time.monotonic() + 150
        while not address_file.exists():
            assert up.poll() is None, up.stdout.read() if up.stdout else ""
            assert time.monotonic() < deadline, "epd up did not write the router address"
            time.sleep(0.2)
        reply = subprocess.run(
            [*epd, "generate", "--run-dir", str(run_dir), "--max-tokens", "4", "hello"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert reply.returncode == 0, reply.stderr
        assert re.search(r"4 tokens, length", reply.stderr), reply.stderr
        logs_dir = run_dir / "latest"  # this run's logs (libs/launch/runs.py)
        log = (logs_dir / "encoder-0.log").read_text()  # JSON lines; the listening line is in the native output
        encoder = re.search(r"^encoder listening on (\S+)$", (logs_dir / "encoder-0.native.log").read_text(), re.M)
        assert encoder is not None
        started = next(_json.loads(line) for line in log.splitlines() if '"starting"' in line)
        assert started["settings"]["cached_max_running"] == "2"
        assert started["settings"]["grace_s"] == "5.0"
        with grpc.insecure_channel(encoder.group(1)) as channel:
            info = service_info_pb2_grpc.ServiceInfoServiceStub(channel).GetServiceInfo(
                service_info_pb2.GetServiceInfoRequest(), timeout=10
            )
        assert "transfer.lease_stamp" in info.info.capabilities
        assert "transfer.checksums" not in info.info.capabilities
        logs = [(logs_dir / f"pd-{i}.native.log").read_text() for i in (0, 1)]
        pds = [re.search(r"^pd listening on (\S+)$", text, re.MULTILINE) for text in logs]
        router = next(
            _json.loads(line) for line in (logs_dir / "router.log").read_text().splitlines() if '"starting"' in line
        )
        assert all(pd is not None and pd.group(1) in str(router["settings"]["pd"]) for pd in pds), router["settings"]
        # `epd up` writes the address file after the door is listening (Stack.up waits for its line).
        assert not (logs_dir / "openai_door.log").exists()  # no process of its own
        door = re.search(r"^openai_door listening on (\S+)$", (logs_dir / "router.native.log").read_text(), re.M)
        assert door is not None
        with urllib.request.urlopen(f"http://{door.group(1)}/health", timeout=10) as health:
            assert health.status == 200  # the router is SERVING
        with urllib.request.urlopen(f"http://{door.group(1)}/v1/models", timeout=10) as models:
            assert [m["id"] for m in _json.loads(models.read())["data"]] == ["omni-tiny"]
    finally:
        if up.poll() is None:
            os.kill(up.pid, signal.SIGINT)
        out, _ = up.communicate(timeout=60)
    assert up.returncode == 0, out
    assert "stopped: {" in out
    assert re.search(r"^OpenAI-compatible API \(model omni-tiny\): base_url=http://\S+/v1$", out, re.MULTILINE), out


@pytest.mark.unit
@pytest.mark.parametrize("layout", sorted(LAYOUT_ROLES))
def test_the_door_is_optional_in_every_layout(layout: str, tmp_path: Path) -> None:
    """Without the role no door runs; with it the door runs where `epd up` puts it by default: in
    the router's process, or as a process of its own in the colocated layout (no router there)."""
    roles: dict[str, Any] = {r: {} for r in LAYOUT_ROLES[layout]}
    without = parse_description(_minimal(layout=layout, roles=roles), Path("x.yaml"))
    assert "openai_door" not in without.roles and without.door_placement is None
    plan = stack_spec(without, run_dir=tmp_path)
    assert plan.spec.openai_door is False and "openai_door" not in plan.spec.extra_args
    with_door = parse_description(_minimal(layout=layout, roles={**roles, "openai_door": {}}), Path("x.yaml"))
    door = with_door.roles["openai_door"]
    assert (door.replicas, door.port, door.cpu, door.memory, door.settings) == (1, 8000, "1", "2Gi", {})
    assert with_door.door_placement == default_door_placement(layout)
    spec = stack_spec(with_door, run_dir=tmp_path).spec
    assert spec.openai_door is True and spec.door_placement == default_door_placement(layout)
    if layout == "colocated":
        assert _parse_flags("openai_door", spec.extra_args["openai_door"]).grace_s == 10.0
    else:
        assert "openai_door" not in spec.extra_args  # the router's process serves it


@pytest.mark.unit
@pytest.mark.parametrize("placement", DOOR_PLACEMENTS)
@pytest.mark.parametrize("layout", ["e+pd", "e/p/d"])
def test_a_description_places_the_door_either_way(layout: str, placement: str, tmp_path: Path) -> None:
    """`roles.openai_door.placement` reaches `StackSpec.door_placement` as `epd up
    --door-placement` does; in the router's process the door's settings are the router's flags."""
    roles: dict[str, Any] = {r: {} for r in LAYOUT_ROLES[layout]}
    settings = {"served_model_name": "omni", "max_body_mib": 8}
    roles["openai_door"] = {"placement": placement, "settings": settings}
    desc = parse_description(_minimal(layout=layout, roles=roles), Path("x.yaml"))
    assert desc.door_placement == placement and desc.door_in_router == (placement == DOOR_IN_ROUTER)
    spec = stack_spec(desc, run_dir=tmp_path).spec
    assert (spec.openai_door, spec.door_placement) == (True, placement)
    router = _parse_flags("router", spec.extra_args["router"])
    if placement == DOOR_IN_ROUTER:
        assert "openai_door" not in spec.extra_args
        assert (router.served_model_name, router.max_body_mib) == ("omni", 8)
    else:
        door = _parse_flags("openai_door", spec.extra_args["openai_door"])
        assert (door.served_model_name, door.max_body_mib) == ("omni", 8)
        assert (router.served_model_name, router.max_body_mib) == ("", 64)  # the router's own defaults


@pytest.mark.unit
@pytest.mark.parametrize(
    ("door", "extra", "expected"),
    [
        (
            {"placement": "router"},
            {"layout": "colocated", "roles": {"colocated": {}}},
            "placement: router needs a router",
        ),
        (
            {"placement": "router", "replicas": 2},
            {},
            "roles.openai_door.replicas: the door runs in the router's process",
        ),
        ({"memory": "1Gi"}, {}, "roles.openai_door.memory: the door runs in the router's process"),
        (
            {"settings": {"request_timeout_s": 30}},
            {},
            "roles.openai_door.settings.request_timeout_s: the door runs in the router's process (placement router): "
            "roles.router.settings.max_request_s applies",
        ),
        ({"settings": {"log_level": "debug"}}, {}, "roles.openai_door.settings.log_level: the door runs in the router"),
        ({}, {"kubernetes": {"openai_door_service_type": "LoadBalancer"}}, "kubernetes.openai_door_service_type: the"),
        ({"port": 50051}, {}, "roles.openai_door.port: 50051 is also roles.router.port"),
        ({"port": 9090}, {}, "roles.openai_door.port: 9090 is also telemetry.metrics_port"),
        (
            {"placement": "elsewhere"},
            {},
            "roles.openai_door.placement: 'elsewhere' is not one of ['router', 'process']",
        ),
    ],
)
def test_a_door_in_the_router_takes_nothing_only_a_process_has(
    door: dict[str, Any], extra: dict[str, Any], expected: str
) -> None:
    doc = _minimal(**extra)
    doc["roles"]["openai_door"] = door
    assert expected in _error(doc)
    if "placement" not in door and not extra:  # as a process of its own the same is fine
        parse_description(
            {**doc, "roles": {**doc["roles"], "openai_door": {**door, "placement": "process"}}}, Path("x")
        )


@pytest.mark.unit
def test_the_door_settings_reach_its_flags(tmp_path: Path) -> None:
    """Each door setting a description may give becomes a flag the door's own parser reads; the
    router address and the model come from the launcher (Stack._start_door), not the flags."""
    settings: dict[str, Any] = {
        "served_model_name": "omni",
        "default_temperature": 0.5,
        "fetch_allow_private": True,
        "max_body_mib": 8,
        "fetch_max_mib": 4,
        "fetch_timeout_s": 2.5,
        "request_timeout_s": 30,
    }
    doc = _minimal(drain={"grace_s": 7})
    doc["roles"]["openai_door"] = {"placement": "process", "replicas": 2, "settings": settings}
    plan = stack_spec(parse_description(doc, Path("x.yaml")), run_dir=tmp_path)
    args = plan.spec.extra_args["openai_door"]
    assert "--model" not in args and "--router" not in args
    door = _parse_flags("openai_door", args)
    for key, value in settings.items():
        assert getattr(door, key) == value, key
    assert door.grace_s == 7.0
    assert plan.notes == ("roles.openai_door.replicas is 2: one openai_door runs on this host",)


def _whisper(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "whisper"}))
    return tmp_path


@pytest.mark.unit
def test_a_description_splitting_whisper_on_vllm_is_refused_naming_it(tmp_path: Path) -> None:
    model = _whisper(tmp_path)
    message = _error(_minimal(engine="vllm", model={"path": str(model)}))
    refused = "engine: --engine vllm with a whisper checkpoint is refused in the e/p/d layout: vLLM 0.32 takes no KV"
    assert refused in message
    assert f"(model.path {model})" in message
    parse_description(_minimal(model={"path": str(model)}), Path("ok.yaml"))  # the reference engine splits it
    e_pd = {"router": {}, "encoder": {}, "pd": {}}
    parse_description(_minimal(engine="vllm", layout="e+pd", roles=e_pd, model={"path": str(model)}), Path("ok.yaml"))


@pytest.mark.unit
def test_epd_up_flags_and_a_stack_refuse_whisper_split_on_vllm(tmp_path: Path) -> None:
    from libs.cli.main import main
    from libs.launch.stack import Stack, StackSpec

    model = _whisper(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["up", "--engine", "vllm", "--layout", "e/p/d", "--model", str(model), "--run-dir", str(tmp_path)])
    assert str(info.value).startswith("epd: --engine vllm with a whisper checkpoint is refused in the e/p/d layout")
    with pytest.raises(ValueError, match="whisper checkpoint is refused in the e/p/d layout"):
        Stack(StackSpec(layout="e/p/d", encoders=1, model=model, run_dir=tmp_path, engine="vllm"))
    Stack(StackSpec(layout="e+pd", encoders=1, model=model, run_dir=tmp_path, engine="vllm"))  # served there


@pytest.mark.unit
def test_epd_ups_door_placement_flag_maps_to_the_stack(tmp_path: Path) -> None:
    """`--door-placement` is `StackSpec.door_placement`; left out, the router's process (the
    colocated layout's door is a process: no router); a description says it itself."""
    from libs.cli.main import _spec, build_parser
    from libs.launch.stack import Stack, StackSpec

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_omni"}))

    def spec(*flags: str) -> StackSpec:
        return _spec(build_parser().parse_args(["up", "--model", str(tmp_path), "--run-dir", str(tmp_path), *flags]))

    for layout in ("e+pd", "e/p/d"):
        assert spec("--layout", layout).door_placement == DOOR_IN_ROUTER == default_door_placement(layout)
        assert spec("--layout", layout, "--door-placement", "router").door_placement == DOOR_IN_ROUTER
        assert spec("--layout", layout, "--door-placement", "process").door_placement == DOOR_PROCESS
    assert spec("--layout", "colocated").door_placement == DOOR_PROCESS
    with pytest.raises(SystemExit, match="--door-placement router needs a router"):
        spec("--layout", "colocated", "--door-placement", "router")
    with pytest.raises(SystemExit, match="--door-placement cannot be combined with --config"):
        spec("--config", str(tmp_path / "stack.yaml"), "--door-placement", "process")
    with pytest.raises(ValueError, match="door placement router needs e\\+pd or e/p/d"):
        Stack(
            StackSpec(layout="colocated", model=tmp_path, run_dir=tmp_path, openai_door=True, door_placement="router")
        )
    with pytest.raises(ValueError, match="unknown door placement 'sidecar'"):
        Stack(StackSpec(layout="e+pd", model=tmp_path, run_dir=tmp_path, openai_door=True, door_placement="sidecar"))
    assert Stack(StackSpec(layout="e+pd", model=tmp_path, run_dir=tmp_path)).door_placement == DOOR_IN_ROUTER


@pytest.mark.unit
def test_placement_is_for_vllm_disaggregated_layouts_and_no_description(tmp_path: Path) -> None:
    import os

    from libs.cli.main import _spec, build_parser
    from libs.launch.stack import StackSpec

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_omni"}))

    def spec(*flags: str) -> StackSpec:
        return _spec(build_parser().parse_args(["up", "--model", str(tmp_path), "--run-dir", str(tmp_path), *flags]))

    assert not spec("--layout", "e+pd", "--engine", "vllm").placement
    if len(os.sched_getaffinity(0)) >= 2:
        assert spec("--layout", "e+pd", "--engine", "vllm", "--placement").placement
        assert spec("--layout", "e/p/d", "--engine", "vllm", "--placement").placement
    with pytest.raises(SystemExit, match="--placement is planned for --engine vllm \\(e\\+pd or e/p/d\\) only"):
        spec("--layout", "e+pd", "--placement")  # the reference engine has no engine process to place
    with pytest.raises(SystemExit, match="--placement cannot be combined with --config"):
        spec("--config", str(tmp_path / "stack.yaml"), "--placement")
