"""Kubernetes manifests (deploy/k8s): rendered from the stack descriptions without drift, valid
against the Kubernetes schemas (kubernetes-validate, strict), and in agreement with the services:
every ConfigMap key is a setting of that role, and the ports, probes, grace period and addresses
the manifests use are the ones the settings say."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from libs.cli.deploy import K8S, STACKS, drift, rendered
from libs.config.settings import load_settings
from libs.launch.config import load_description, parse_description
from libs.launch.k8s import (
    EXIT_MARGIN_S,
    LANE_LABEL,
    OCCUPANCY_METRIC,
    documents,
    overlay_files,
    render,
)
from tests.support.service_settings import SETTINGS

KUBERNETES_VERSION = "1.33.0"
DESCRIPTIONS = sorted(STACKS.glob("*.yaml"))


def _committed() -> dict[Path, list[dict[str, Any]]]:
    return {path: list(documents(path.read_text())) for path in sorted(K8S.rglob("*.yaml"))}


def _by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _validate(doc: dict[str, Any]) -> None:
    if doc["kind"] == "Kustomization":
        return  # not an API object: checked by building it (below)
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.unit
def test_committed_manifests_are_what_the_descriptions_render() -> None:
    files = rendered(DESCRIPTIONS, K8S)
    assert drift(files, K8S) == [], "deploy/k8s is stale: run `epd deploy render`"
    assert len(files) == len(list(K8S.rglob("*.yaml")))


@pytest.mark.unit
def test_drift_is_detected(tmp_path: Path) -> None:
    files = rendered(DESCRIPTIONS, tmp_path)
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    target = tmp_path / "overlays" / "e-p-d" / "encoder.yaml"
    target.write_text(target.read_text().replace("EPD_GRACE_S: '10'", "EPD_GRACE_S: '11'"))
    (tmp_path / "overlays" / "e-p-d" / "extra.yaml").write_text("{}\n")
    assert drift(files, tmp_path) == [
        f"{target}: differs",
        f"{tmp_path / 'overlays' / 'e-p-d' / 'extra.yaml'}: not rendered from any description",
    ]


@pytest.mark.unit
def test_every_committed_manifest_is_valid_kubernetes() -> None:
    kinds: dict[str, int] = {}
    for docs in _committed().values():
        for doc in docs:
            _validate(doc)
            kinds[doc["kind"]] = kinds.get(doc["kind"], 0) + 1
    for kind in ("Deployment", "Service", "ConfigMap", "PodDisruptionBudget", "HorizontalPodAutoscaler"):
        assert kinds.get(kind), f"no {kind} rendered"
    assert kinds["NetworkPolicy"] == 1 and kinds["ServiceAccount"] == 1


@pytest.mark.unit
def test_variants_render_valid_kubernetes() -> None:
    """TLS (cert-manager CSI volumes, token secret), a model volume and a LoadBalancer router."""
    base = load_description(STACKS / "e-p-d.yaml").raw
    doc = {
        **base,
        "tls": {"enabled": True},
        "model": {**base["model"], "volume_claim": "epd-models"},
        "kubernetes": {**base["kubernetes"], "router_service_type": "LoadBalancer"},
    }
    desc = parse_description(doc, Path("variant.yaml"))
    docs = [d for text in overlay_files(desc, "variant.yaml").values() for d in documents(text)]
    for d in docs:
        _validate(d)
    encoder = _by_kind(docs, "Deployment")["epd-encoder"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in encoder["volumes"]}
    assert volumes["tls"]["csi"]["volumeAttributes"]["csi.cert-manager.io/common-name"] == "epd-encoder"
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "epd-models", "readOnly": True}
    router = _by_kind(docs, "Deployment")["epd-router"]["spec"]["template"]["spec"]
    assert {v["name"] for v in router["volumes"]} == {"tls", "tokens"}
    # Probes never need TLS: the plaintext health port, as without TLS.
    assert encoder["containers"][0]["readinessProbe"]["grpc"]["port"] == desc["telemetry"]["health_port"]
    config = _by_kind(docs, "ConfigMap")["epd-router"]["data"]
    assert config["EPD_AUTH_TOKENS_FILE"] == "/etc/epd/tokens/tokens" and config["EPD_TLS_CA"] == "/etc/epd/tls/ca.crt"


@pytest.mark.unit
def test_a_vllm_gpu_description_reaches_the_engine_arguments() -> None:
    """engine: vllm on GPUs: the description's engine settings reach each pod's ConfigMap, which
    the service parses into vLLM's engine arguments and environment (the pod's IP as the engine's
    host: EPD_HOST from the pod, the NIXL side channel there)."""
    from libs.backends.vllm import runtime

    base = load_description(STACKS / "e-p-d.yaml").raw
    gpu = {"device": "cuda", "dtype": "bfloat16", "gpu_memory_utilization": 0.9, "enforce_eager": False}
    roles = {**base["roles"]}
    for role in ("prefill", "decode"):
        roles[role] = {**roles[role], "settings": {**gpu, "tensor_parallel_size": 2}}
    desc = parse_description({**base, "engine": "vllm", "roles": roles}, Path("gpu.yaml"))
    docs = [d for text in overlay_files(desc, "gpu.yaml").values() for d in documents(text)]
    configs = _by_kind(docs, "ConfigMap")
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        settings = _settings(role, configs[f"epd-{role}"]["data"])
        kv = runtime.KvTransfer(kv_role, "e", 5600)  # type: ignore[arg-type]
        args = runtime.engine_args(settings, failure_dir=Path("/tmp"), ec_consumer=role == "prefill", kv=kv)
        assert (args["dtype"], args["enforce_eager"], args["tensor_parallel_size"]) == ("bfloat16", False, 2)
        assert args["gpu_memory_utilization"] == 0.9 and args["kv_transfer_config"]["kv_buffer_device"] == "cuda"
        env = runtime.engine_environment(settings, kv)
        assert (env["VLLM_NIXL_SIDE_CHANNEL_HOST"], env["UCX_NET_DEVICES"], env["UCX_TLS"]) == (
            "10.1.2.3",
            "eth0",
            "tcp",
        )


@pytest.mark.unit
def test_a_vllm_encoder_description_reaches_the_encoders_pod() -> None:
    """encoder_engine: vllm: the encoder's ConfigMap carries EPD_ENGINE=vllm and its engine
    settings, which the encoder service parses into vLLM's encoder-only arguments; the LM roles
    keep their own engine."""
    from libs.backends.vllm import runtime

    base = load_description(STACKS / "e-p-d.yaml").raw
    roles = {**base["roles"], "encoder": {**base["roles"]["encoder"], "settings": {"dtype": "bfloat16"}}}
    desc = parse_description(
        {**base, "encoder_engine": "vllm", "model": {"path": "var/models/qwen2_5_vl-tiny"}, "roles": roles},
        Path("enc.yaml"),
    )
    docs = [d for text in overlay_files(desc, "enc.yaml").values() for d in documents(text)]
    configs = _by_kind(docs, "ConfigMap")
    assert configs["epd-encoder"]["data"]["EPD_ENGINE"] == "vllm"
    assert (
        "EPD_ENGINE" not in configs["epd-prefill"]["data"]
        or configs["epd-prefill"]["data"]["EPD_ENGINE"] == "reference"
    )
    settings = _settings("encoder", configs["epd-encoder"]["data"])
    args = runtime.engine_args(settings, failure_dir=Path("/tmp"), ec_consumer=False, ec_producer=True)
    assert (args["dtype"], args["mm_encoder_only"], args["ec_transfer_config"]["ec_role"]) == (
        "bfloat16",
        True,
        "ec_producer",
    )


@pytest.mark.unit
def test_an_invalid_manifest_is_refused() -> None:
    """The validator is not a no-op: a Deployment with a string replica count fails."""
    deployment = _by_kind(next(iter(v for k, v in _committed().items() if k.name == "encoder.yaml")), "Deployment")
    doc = dict(deployment["epd-encoder"])
    doc["spec"] = {**doc["spec"], "replicas": "two"}
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(doc)


def _settings(role: str, config: dict[str, str]) -> Any:
    cls = SETTINGS[role]
    names = {"EPD_" + f.name.upper() for f in dataclasses.fields(cls)}
    unknown = set(config) - names
    assert not unknown, f"{role}: ConfigMap keys that are no setting of the service: {unknown}"
    return load_settings(cls, argv=[], env={**config, "EPD_HOST": "10.1.2.3"})


@pytest.mark.unit
@pytest.mark.parametrize("description", DESCRIPTIONS, ids=lambda p: p.stem)
def test_manifests_agree_with_the_services_settings(description: Path) -> None:
    desc = load_description(description)
    overlay = K8S / "overlays" / desc.name
    docs = [d for path in sorted(overlay.glob("*.yaml")) for d in documents(path.read_text())]
    deployments, services = _by_kind(docs, "Deployment"), _by_kind(docs, "Service")
    configs = _by_kind(docs, "ConfigMap")
    namespace = desc["kubernetes"]["namespace"]
    for role in desc.roles:
        if role == "openai_door":
            continue  # HTTP, not gRPC: test_the_door_* below
        name = f"epd-{role}"
        settings = _settings(role, configs[name]["data"])
        pod = deployments[name]["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert container["command"] == ["python", "-m", f"services.{role}"]
        assert container["envFrom"] == [{"configMapRef": {"name": name}}]
        assert container["env"][0]["name"] == "EPD_HOST"
        assert container["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        expected = {"grpc": settings.port, "health": settings.health_port, "metrics": settings.metrics_port}
        door_here = role == "router" and desc.door_in_router
        if door_here:  # the door's HTTP port, its readiness (test_a_door_in_the_router_* below)
            expected["http"] = settings.openai_port
        assert ports == expected
        assert settings.host == "10.1.2.3"  # from the pod, not the ConfigMap
        for probe in (
            ("startupProbe", "livenessProbe") if door_here else ("startupProbe", "readinessProbe", "livenessProbe")
        ):
            assert container[probe]["grpc"] == {"port": settings.health_port}, (role, probe)
        annotations = deployments[name]["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(settings.metrics_port)
        prestop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert pod["terminationGracePeriodSeconds"] >= prestop + settings.grace_s + EXIT_MARGIN_S
        service = services[name]["spec"]
        assert service["ports"][0]["port"] == settings.port and service["ports"][0]["targetPort"] == "grpc"
        assert service["selector"].items() <= deployments[name]["spec"]["template"]["metadata"]["labels"].items()
        if role in ("encoder", "prefill", "decode", "pd", "colocated"):
            assert (settings.ucx_tls, settings.ucx_net_devices) == ("tcp", "eth0")
            assert settings.pool_mib == desc["transport"]["pool_mib"]
    if "router" in desc.roles:
        router = _settings("router", configs["epd-router"]["data"])
        encoder = desc.roles["encoder"]
        assert router.encoders == (f"dns:///epd-encoder.{namespace}.svc.cluster.local:{encoder.port}",)
        assert services["epd-encoder"]["spec"]["clusterIP"] == "None"  # headless: one A record per encoder
        encoder_prestop = deployments["epd-encoder"]["spec"]["template"]["spec"]["containers"][0]["lifecycle"]
        # A terminating encoder keeps working until routers re-resolved without it.
        assert encoder_prestop["preStop"]["sleep"]["seconds"] >= router.discovery_refresh_s
        for backend in ("prefill", "decode", "pd"):
            if backend in desc.roles:
                port = services[f"epd-{backend}"]["spec"]["ports"][0]["port"]
                # A pool, like the encoders: every ready pod of the headless Service is a member.
                assert getattr(router, backend) == (f"dns:///epd-{backend}.{namespace}.svc.cluster.local:{port}",)
                assert services[f"epd-{backend}"]["spec"]["clusterIP"] == "None"
                lifecycle = deployments[f"epd-{backend}"]["spec"]["template"]["spec"]["containers"][0]["lifecycle"]
                assert lifecycle["preStop"]["sleep"]["seconds"] >= router.discovery_refresh_s
    if desc.store_enabled:
        master = services["epd-store-master"]["spec"]["ports"][0]["port"]
        for role in ("encoder", "router"):
            assert _settings(role, configs[f"epd-{role}"]["data"]).cache_master.endswith(f":{master}")
        assert {"epd-store-master", "epd-store-holder"} <= set(deployments)


@pytest.mark.unit
def test_the_encoder_autoscaler_reads_the_occupancy_gauge() -> None:
    docs = list(documents((K8S / "overlays" / "e-p-d" / "encoder.yaml").read_text()))
    (hpa,) = _by_kind(docs, "HorizontalPodAutoscaler").values()
    (metric,) = hpa["spec"]["metrics"]
    assert metric["pods"]["metric"] == {"name": OCCUPANCY_METRIC, "selector": {"matchLabels": {LANE_LABEL: "encoder"}}}
    assert hpa["spec"]["scaleTargetRef"]["name"] == "epd-encoder"
    assert "replicas" not in _by_kind(docs, "Deployment")["epd-encoder"]["spec"]  # the autoscaler owns it


def _kustomize_build(overlay: Path) -> list[tuple[str, str]]:
    """What `kustomize build` includes (resources, recursively): (kind, name) pairs."""
    import yaml

    kustomization = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    found = []
    for resource in kustomization["resources"]:
        target = (overlay / resource).resolve()
        if target.is_dir():
            found += _kustomize_build(target)
        else:
            assert target.exists(), f"{overlay}: {resource} missing"
            found += [(d["kind"], d["metadata"]["name"]) for d in documents(target.read_text())]
    return found


@pytest.mark.integration
@pytest.mark.parametrize("description", DESCRIPTIONS, ids=lambda p: p.stem)
def test_each_overlay_builds_with_the_base(description: Path) -> None:
    overlay = K8S / "overlays" / load_description(description).name
    expected = sorted(_kustomize_build(overlay))
    assert ("ServiceAccount", "epd") in expected and ("NetworkPolicy", "epd-internal") in expected
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with its built-in kustomize) is not installed: resources checked by file only")
    out = subprocess.run([kubectl, "kustomize", str(overlay)], capture_output=True, text=True, timeout=60, check=True)
    built = list(documents(out.stdout))
    assert sorted((d["kind"], d["metadata"]["name"]) for d in built) == expected
    namespace = load_description(description)["kubernetes"]["namespace"]
    (created,) = [d for d in built if d["kind"] == "Namespace"]  # the overlay creates its own
    assert created["metadata"]["name"] == namespace
    assert all(d["metadata"].get("namespace") == namespace for d in built if d is not created)


@pytest.mark.unit
def test_render_writes_one_overlay_per_description(tmp_path: Path) -> None:
    descs = [load_description(p) for p in DESCRIPTIONS]
    files = render(descs, tmp_path)
    overlays = {p.parent.name for p in files if p.parent.parent.name == "overlays"}
    assert overlays == {d.name for d in descs}


def _door(desc_docs: list[dict[str, Any]]) -> tuple[Any, dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The door's parsed settings (its own loader), pod spec, container and Service spec."""
    config = _by_kind(desc_docs, "ConfigMap")["epd-openai-door"]["data"]
    settings = _settings("openai_door", config)
    pod = _by_kind(desc_docs, "Deployment")["epd-openai-door"]["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    return settings, pod, container, _by_kind(desc_docs, "Service")["epd-openai-door"]["spec"]


@pytest.mark.unit
@pytest.mark.parametrize("description", DESCRIPTIONS, ids=lambda p: p.stem)
def test_the_door_manifests_agree_with_its_settings(description: Path) -> None:
    """The door's Deployment and Service: HTTP on the role's port, probes on that port, the router's
    (or colocated service's) Service as --router, the model path as --model, its own settings."""
    desc = load_description(description)
    overlay = K8S / "overlays" / desc.name
    if desc.door_placement != "process":
        assert not (overlay / "openai-door.yaml").exists()
        return
    docs = list(documents((overlay / "openai-door.yaml").read_text()))
    settings, pod, container, service = _door(docs)
    role = desc.roles["openai_door"]
    front = "colocated" if desc.layout == "colocated" else "router"
    namespace = desc["kubernetes"]["namespace"]
    assert settings.router == f"epd-{front}.{namespace}.svc.cluster.local:{desc.roles[front].port}"
    assert str(settings.model) == desc["model"]["path"]
    assert settings.port == role.port and settings.host == "10.1.2.3"
    for key, value in role.settings.items():
        assert getattr(settings, key) == value, key
    assert container["command"] == ["python", "-m", "services.openai_door"]
    assert container["ports"] == [{"name": "http", "containerPort": role.port, "protocol": "TCP"}]
    assert container["resources"]["requests"] == {"cpu": role.cpu, "memory": role.memory}
    # Readiness follows the router (/health: 503 unless it is SERVING); startup and liveness only
    # the door's own server, so a router outage does not restart every door.
    paths = {
        probe: container[probe]["httpGet"]["path"] for probe in ("startupProbe", "readinessProbe", "livenessProbe")
    }
    assert paths == {"startupProbe": "/metrics", "readinessProbe": "/health", "livenessProbe": "/metrics"}
    for probe in paths:
        assert container[probe]["httpGet"]["port"] == "http" and container[probe]["httpGet"]["scheme"] == "HTTP"
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(role.port)
    assert pod["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"
    prestop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["spec"]["terminationGracePeriodSeconds"] >= prestop + settings.grace_s + EXIT_MARGIN_S
    assert service["ports"] == [{"name": "http", "port": role.port, "targetPort": "http", "protocol": "TCP"}]
    assert service["type"] == desc["kubernetes"]["openai_door_service_type"]
    assert service["selector"].items() <= pod["metadata"]["labels"].items()
    # Nothing the door does not bind: no gRPC health or separate metrics port.
    assert settings.health_port == 0 and settings.metrics_port == 0


@pytest.mark.unit
@pytest.mark.parametrize("layout", ["colocated", "e+pd"])
def test_the_door_renders_in_every_layout_with_tls(layout: str) -> None:
    """With TLS the door gets its certificate (CN epd-openai-door), the clients' token secret and
    HTTPS probes and scrape; in front of a colocated service it calls that service's Service."""
    roles: dict[str, Any] = {"colocated": {}} if layout == "colocated" else {"router": {}, "encoder": {}, "pd": {}}
    roles["openai_door"] = {
        "placement": "process",
        "port": 8443,
        "settings": {"fetch_allow_private": True, "max_body_mib": 8},
    }
    doc = {
        "version": 1,
        "name": "door",
        "layout": layout,
        "roles": roles,
        "tls": {"enabled": True},
        "kubernetes": {"openai_door_service_type": "LoadBalancer"},
    }
    desc = parse_description(doc, Path("door.yaml"))
    files = overlay_files(desc, "door.yaml")
    assert "openai-door.yaml" in yaml_resources(files["kustomization.yaml"])
    docs = list(documents(files["openai-door.yaml"]))
    for d in docs:
        _validate(d)
    settings, pod, container, service = _door(docs)
    front = "colocated" if layout == "colocated" else "router"
    assert settings.router == f"epd-{front}.epd-door.svc.cluster.local:{desc.roles[front].port}"
    assert (settings.fetch_allow_private, settings.max_body_mib, settings.port) == (True, 8, 8443)
    assert str(settings.tls_cert) == "/etc/epd/tls/tls.crt" and str(settings.tls_ca) == "/etc/epd/tls/ca.crt"
    assert str(settings.auth_tokens_file) == "/etc/epd/tokens/tokens"
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert set(volumes) == {"tls", "tokens"}  # no model volume: the door reads no weights
    assert volumes["tls"]["csi"]["volumeAttributes"]["csi.cert-manager.io/common-name"] == "epd-openai-door"
    assert volumes["tokens"]["secret"]["secretName"] == desc["tls"]["tokens_secret"]
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/etc/epd/tls", "/etc/epd/tokens"}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["scheme"] == "HTTPS"  # kubelet does not verify the certificate
    assert pod["metadata"]["annotations"]["prometheus.io/scheme"] == "https"
    assert service["type"] == "LoadBalancer"


def yaml_resources(text: str) -> list[str]:
    (kustomization,) = documents(text)
    resources: list[str] = kustomization["resources"]
    return resources


def _router(docs: list[dict[str, Any]]) -> tuple[Any, dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The router's parsed settings (its own loader), pod template, container and Service spec."""
    settings = _settings("router", _by_kind(docs, "ConfigMap")["epd-router"]["data"])
    pod = _by_kind(docs, "Deployment")["epd-router"]["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    return settings, pod, container, _by_kind(docs, "Service")["epd-router"]["spec"]


@pytest.mark.unit
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.parametrize("layout", ["e+pd", "e/p/d"])
def test_a_door_in_the_router_renders_as_the_routers_port(layout: str, tls: bool) -> None:
    """placement router: no door Deployment, Service or ConfigMap; the router's ConfigMap carries
    the door's port and settings (its own loader reads them), its pod and Service the HTTP port,
    its readiness the door's /health (HTTPS with TLS), its scrape annotation its metrics port,
    where the door's instruments are too. placement process renders the door's own files."""
    roles: dict[str, Any] = {
        r: {} for r in ("router", "encoder", *(("pd",) if layout == "e+pd" else ("prefill", "decode")))
    }
    settings = {"served_model_name": "omni", "fetch_allow_private": True, "max_body_mib": 8}
    roles["openai_door"] = {"port": 8080, "settings": settings}
    roles["router"] = {"settings": {"max_request_s": 120}}
    doc = {"version": 1, "name": "door", "layout": layout, "roles": roles, "tls": {"enabled": tls}}
    desc = parse_description(doc, Path("door.yaml"))
    assert desc.door_in_router  # the default placement
    files = overlay_files(desc, "door.yaml")
    assert "openai-door.yaml" not in files and "openai-door.yaml" not in yaml_resources(files["kustomization.yaml"])
    docs = [d for text in files.values() for d in documents(text)]
    for d in docs:
        _validate(d)
    assert not any(d.get("metadata", {}).get("name") == "epd-openai-door" for d in docs)
    router, pod, container, service = _router(docs)
    assert (router.openai_port, str(router.model), router.max_request_s) == (8080, desc["model"]["path"], 120.0)
    for key, value in settings.items():
        assert getattr(router, key) == value, key
    assert {"name": "http", "containerPort": 8080, "protocol": "TCP"} in container["ports"]
    assert {"name": "http", "port": 8080, "targetPort": "http", "protocol": "TCP"} in service["ports"]
    assert service["ports"][0] == {"name": "grpc", "port": router.port, "targetPort": "grpc", "protocol": "TCP"}
    assert service["type"] == desc["kubernetes"]["router_service_type"]
    readiness = container["readinessProbe"]["httpGet"]
    assert readiness == {"path": "/health", "port": "http", "scheme": "HTTPS" if tls else "HTTP"}
    assert container["livenessProbe"]["grpc"] == {"port": router.health_port}
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(router.metrics_port)
    if tls:  # the router's certificate and the clients' tokens serve the door too
        assert (
            str(router.tls_cert) == "/etc/epd/tls/tls.crt" and str(router.auth_tokens_file) == "/etc/epd/tokens/tokens"
        )

    roles["openai_door"] = {**roles["openai_door"], "placement": "process"}
    apart = parse_description({**doc, "roles": roles}, Path("door.yaml"))
    files = overlay_files(apart, "door.yaml")
    assert "openai-door.yaml" in yaml_resources(files["kustomization.yaml"])
    router, _, container, service = _router([d for text in files.values() for d in documents(text)])
    assert router.openai_port == -1 and all(p["name"] != "http" for p in [*container["ports"], *service["ports"]])
    assert "grpc" in container["readinessProbe"]
