"""Kubernetes manifests rendered from a stack description (`epd deploy render`).

deploy/k8s/base: what every layout shares (a service account without API credentials, and a
NetworkPolicy that lets only EPD pods reach the internal roles: UCX moves tensors over TCP in
clear, docs/security.md). deploy/k8s/overlays/<stack name>: one file per role with its ConfigMap
(the role's own EPD_* settings, nothing else), Deployment, Service and, where it applies, a
PodDisruptionBudget and the encoder pool's HorizontalPodAutoscaler; the Mooncake Store master and
holder as Deployments of their own. Choices (docs/deploy.md says why):

- services bind the pod's IP (EPD_HOST from the downward API): producers put their own address
  into tensor handles, so it must be one peers can dial;
- kubelet's gRPC probes cannot speak TLS, so every service also serves grpc.health.v1 alone,
  plaintext, on EPD_HEALTH_PORT, and all probes go there (the same rule with TLS on or off);
- the router finds its encoders, prefills, decodes (or PDs) through their headless Services' A
  records (EPD_ENCODERS, EPD_PREFILL, EPD_DECODE, EPD_PD = dns:///...), re-resolved every
  `discovery.refresh_s`: every ready pod of a role is a member of the router's pool of it; a
  terminating pod keeps serving for `drain.prestop_s` (preStop sleep) so routers drop it first,
  then drains for EPD_GRACE_S: the grace period covers both plus a margin for the process to exit;
- NIXL over TCP on the pod interface (EPD_UCX_TLS=tcp, EPD_UCX_NET_DEVICES=eth0): pods on one node
  are in different PID namespaces, where cross-memory attach does not work;
- the OpenAI door (roles.openai_door) is HTTP. As a process of its own (`epd-openai-door`,
  placement process) its probes are HTTP GETs on its own port (HTTPS with TLS: kubelet does not
  verify the certificate), it serves /metrics there too, and it calls the router's (or the
  colocated service's) Service as a client, with its own certificate and the clients' tokens as the
  router checks them. In the router's process (placement router) its port is one more port of the
  router's pods and Service (EPD_OPENAI_PORT), and the router's readiness is the door's /health
  (the door opens after the gRPC server, and both close with the router's drain); the door's
  instruments are on the router's metrics port.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from libs.launch.config import (
    DOOR,
    MODEL_ROLES,
    POOLED,
    DescriptionError,
    Role,
    StackDescription,
    env_name,
    env_value,
    role_settings,
)
from libs.launch.process import ROOT

PART_OF = "epd"
SERVICE_ACCOUNT = "epd"
TLS_MOUNT = "/etc/epd/tls"
TOKENS_MOUNT = "/etc/epd/tokens"
# Seconds between the end of the drain and SIGKILL: the process closes its engine and transport.
EXIT_MARGIN_S = 5
MODULES = {role: f"services.{role}" for role in ("router", "encoder", "prefill", "decode", "pd", "colocated", DOOR)}
# Roles clients call: they get the bearer tokens secret with TLS, and a Service type of their own.
PUBLIC = ("router", "colocated", DOOR)
STORE_MASTER = "store-master"
STORE_HOLDER = "store-holder"
HEADER = "# Rendered by `epd deploy render` from {source}; edit the description and render again.\n"


def component(role: str) -> str:
    """The role as Kubernetes names it (DNS-1123: `openai_door` is `openai-door`)."""
    return role.replace("_", "-")


def name_of(role: str) -> str:
    return f"epd-{component(role)}"


def labels(role: str, stack: str | None = None) -> dict[str, str]:
    out = {"app.kubernetes.io/name": PART_OF, "app.kubernetes.io/component": component(role)}
    if stack is not None:
        out["app.kubernetes.io/instance"] = stack
    return out


def selector(role: str) -> dict[str, Any]:
    return {"matchLabels": labels(role)}


def service_host(desc: StackDescription, role: str) -> str:
    return f"{name_of(role)}.{desc['kubernetes']['namespace']}.svc.cluster.local"


def grace_period_s(desc: StackDescription) -> int:
    """preStop sleep, then the service's drain (EPD_GRACE_S), then a margin to exit."""
    return int(desc["drain"]["prestop_s"] + math.ceil(desc["drain"]["grace_s"]) + EXIT_MARGIN_S)


def role_environment(desc: StackDescription, role: str) -> dict[str, str]:
    """The role's ConfigMap: EPD_* settings of that service only (EPD_HOST comes from the pod)."""
    telemetry = desc["telemetry"]
    values = dict(role_settings(desc, role))
    values["port"] = desc.roles[role].port
    if role != DOOR:  # the door serves health and metrics on its HTTP port
        values |= {"health_port": telemetry["health_port"], "metrics_port": telemetry["metrics_port"]}
    values |= {
        "log_format": "json",
        "trace_exporter": telemetry["trace_exporter"],
        "otlp_endpoint": telemetry["otlp_endpoint"],
    }
    if role in MODEL_ROLES:
        values |= {"ucx_net_devices": desc["transport"]["ucx_net_devices"], "ucx_tls": desc["transport"]["ucx_tls"]}
    store = desc["cache"]["store"]
    if desc.store_enabled and role in ("encoder", "router"):
        values["cache_master"] = f"{service_host(desc, STORE_MASTER)}:{store['master_port']}"
    if role == "router":
        values["encoders"] = f"dns:///{service_host(desc, 'encoder')}:{desc.roles['encoder'].port}"
        for backend in ("prefill", "decode", "pd"):
            if backend in desc.roles:
                values[backend] = f"dns:///{service_host(desc, backend)}:{desc.roles[backend].port}"
    if role == DOOR:
        front = "colocated" if desc.layout == "colocated" else "router"
        values["router"] = f"{service_host(desc, front)}:{desc.roles[front].port}"
    if role == "router" and desc.door_in_router:
        values["openai_port"] = desc.roles[DOOR].port
    if desc.tls:
        values |= {
            "tls_ca": f"{TLS_MOUNT}/ca.crt",
            "tls_cert": f"{TLS_MOUNT}/tls.crt",
            "tls_key": f"{TLS_MOUNT}/tls.key",
        }
        if role in PUBLIC:
            values["auth_tokens_file"] = f"{TOKENS_MOUNT}/tokens"
    return {env_name(k): env_value(v) for k, v in values.items()}


def _config_map(desc: StackDescription, role: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name_of(role), "labels": labels(role, desc.name)},
        "data": role_environment(desc, role),
    }


def _grpc_probe(port: int, period_s: int, failures: int) -> dict[str, Any]:
    return {"grpc": {"port": port}, "periodSeconds": period_s, "failureThreshold": failures, "timeoutSeconds": 2}


def _http_probe(desc: StackDescription, path: str, period_s: int, failures: int) -> dict[str, Any]:
    get = {"path": path, "port": "http", "scheme": "HTTPS" if desc.tls else "HTTP"}
    return {"httpGet": get, "periodSeconds": period_s, "failureThreshold": failures, "timeoutSeconds": 3}


def _probes(desc: StackDescription, role: str) -> dict[str, Any]:
    """Startup, readiness and liveness. gRPC services: all on the plaintext health port (loading a
    model takes a while: the startup probe allows 5 minutes before liveness applies). The door:
    readiness on /health, which is 200 only while the router is SERVING, so traffic goes to doors
    that can serve it; startup and liveness on /health too would restart every door whenever the
    router is down, so they check the door's own HTTP server (/metrics answers without the router)."""
    if role == DOOR:
        return {
            "startupProbe": _http_probe(desc, "/metrics", 2, 30),
            "readinessProbe": _http_probe(desc, "/health", 2, 1),
            "livenessProbe": _http_probe(desc, "/metrics", 10, 6),
        }
    health = desc["telemetry"]["health_port"]
    # A router serving the door is ready once both listen and until it drains: the door's /health.
    in_router = role == "router" and desc.door_in_router
    return {
        "startupProbe": _grpc_probe(health, 2, 150),
        "readinessProbe": _http_probe(desc, "/health", 2, 1) if in_router else _grpc_probe(health, 2, 1),
        "livenessProbe": _grpc_probe(health, 10, 6),
    }


def _ports(desc: StackDescription, role: Role) -> list[dict[str, Any]]:
    if role.name == DOOR:  # HTTP: the API, /health and /metrics on one port
        return [{"name": "http", "containerPort": role.port, "protocol": "TCP"}]
    telemetry = desc["telemetry"]
    ports = [
        {"name": "grpc", "containerPort": role.port, "protocol": "TCP"},
        {"name": "health", "containerPort": telemetry["health_port"], "protocol": "TCP"},
        {"name": "metrics", "containerPort": telemetry["metrics_port"], "protocol": "TCP"},
    ]
    if role.name == "router" and desc.door_in_router:
        ports.append({"name": "http", "containerPort": desc.roles[DOOR].port, "protocol": "TCP"})
    return ports


def _scrape(desc: StackDescription, role: Role) -> dict[str, str]:
    """Prometheus scrape annotations: the metrics port, or the door's own port (over HTTPS with TLS)."""
    if role.name == DOOR:
        scrape = {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(role.port),
            "prometheus.io/path": "/metrics",
        }
        return scrape | ({"prometheus.io/scheme": "https"} if desc.tls else {})
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(desc["telemetry"]["metrics_port"])}


def _volumes(desc: StackDescription, role: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    if desc.tls:
        csi = {"driver": CSI_DRIVER, "readOnly": True, "volumeAttributes": _csi(desc, role)}
        volumes.append({"name": "tls", "csi": csi})
        mounts.append({"name": "tls", "mountPath": TLS_MOUNT, "readOnly": True})
        if role in PUBLIC:
            tokens = {"secretName": desc["tls"]["tokens_secret"], "defaultMode": 0o440}
            volumes.append({"name": "tokens", "secret": tokens})
            mounts.append({"name": "tokens", "mountPath": TOKENS_MOUNT, "readOnly": True})
    claim = desc["model"].get("volume_claim")
    if claim and role in MODEL_ROLES:
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": "model", "mountPath": _model_mount(desc), "readOnly": True})
    return volumes, mounts


CSI_DRIVER = "csi.cert-manager.io"


def _csi(desc: StackDescription, role: str) -> dict[str, str]:
    """A certificate per pod from cert-manager's CSI driver (ca.crt, tls.crt, tls.key): CN
    epd-<role> (the role peers check) and the pod's IP, the address in the handles it produces."""
    return {
        "csi.cert-manager.io/issuer-name": desc["tls"]["issuer"],
        "csi.cert-manager.io/issuer-kind": desc["tls"]["issuer_kind"],
        "csi.cert-manager.io/common-name": name_of(role),
        "csi.cert-manager.io/ip-sans": "${POD_IP}",
        "csi.cert-manager.io/dns-names": f"{service_host(desc, role)},{name_of(role)}",
        "csi.cert-manager.io/fs-group": "10001",
    }


def _model_mount(desc: StackDescription) -> str:
    path = str(desc["model"]["path"])
    return path if path.startswith("/") else f"/app/{path}"


def _pod_security() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001}


def _container_security() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def _deployment(desc: StackDescription, role: Role) -> dict[str, Any]:
    volumes, mounts = _volumes(desc, role.name)
    container: dict[str, Any] = {
        "name": component(role.name),
        "image": desc["image"],
        "command": ["python", "-m", MODULES[role.name]],
        "ports": _ports(desc, role),
        "envFrom": [{"configMapRef": {"name": name_of(role.name)}}],
        # Bind the pod's own address: it goes into tensor handles and must be dialable by peers.
        "env": [{"name": env_name("host"), "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "resources": {
            "requests": {"cpu": role.cpu, "memory": role.memory},
            "limits": {"memory": role.memory},
        },
        **_probes(desc, role.name),
        "lifecycle": {"preStop": {"sleep": {"seconds": desc["drain"]["prestop_s"]}}},
        "securityContext": _container_security(),
    }
    if mounts:
        container["volumeMounts"] = mounts
    pod: dict[str, Any] = {
        "serviceAccountName": SERVICE_ACCOUNT,
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": grace_period_s(desc),
        "securityContext": _pod_security(),
        "containers": [container],
    }
    if volumes:
        pod["volumes"] = volumes
    spec: dict[str, Any] = {
        "selector": selector(role.name),
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
        "template": {
            "metadata": {
                "labels": labels(role.name, desc.name),
                "annotations": _scrape(desc, role),
            },
            "spec": pod,
        },
    }
    if role.autoscale is None:
        spec = {"replicas": role.replicas, **spec}  # with an autoscaler, it owns the count
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name_of(role.name), "labels": labels(role.name, desc.name)},
        "spec": spec,
    }


def _service(desc: StackDescription, role: Role) -> dict[str, Any]:
    port = "http" if role.name == DOOR else "grpc"
    spec: dict[str, Any] = {
        "selector": labels(role.name),
        "ports": [{"name": port, "port": role.port, "targetPort": port, "protocol": "TCP"}],
    }
    if role.name == "router" and desc.door_in_router:
        spec["ports"].append({"name": "http", "port": desc.roles[DOOR].port, "targetPort": "http", "protocol": "TCP"})
    if role.name in POOLED:
        # Headless: one A record per ready pod, what the router's dns:/// discovery reads.
        spec |= {"clusterIP": "None", "publishNotReadyAddresses": False}
    elif role.name == DOOR:
        spec["type"] = desc["kubernetes"]["openai_door_service_type"]
    elif role.name in ("router", "colocated"):
        spec["type"] = desc["kubernetes"]["router_service_type"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name_of(role.name), "labels": labels(role.name, desc.name)},
        "spec": spec,
    }


def _disruption_budget(desc: StackDescription, role: Role) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": name_of(role.name), "labels": labels(role.name, desc.name)},
        "spec": {"maxUnavailable": 1, "selector": selector(role.name)},
    }


# The gauge the autoscaler reads (libs/rpc/admission.py) as Prometheus names it, and the lane.
OCCUPANCY_METRIC = "epd_admission_occupancy"
LANE_LABEL = "epd_lane"


def _autoscaler(desc: StackDescription, role: Role) -> dict[str, Any]:
    assert role.autoscale is not None
    target = f"{round(role.autoscale.target_occupancy * 1000)}m"
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": name_of(role.name), "labels": labels(role.name, desc.name)},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name_of(role.name)},
            "minReplicas": role.autoscale.min_replicas,
            "maxReplicas": role.autoscale.max_replicas,
            # Per-pod occupancy of the compute lane, served to the HPA by a Prometheus adapter.
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": OCCUPANCY_METRIC, "selector": {"matchLabels": {LANE_LABEL: role.name}}},
                        "target": {"type": "AverageValue", "averageValue": target},
                    },
                }
            ],
            # Scale down slowly: each removed encoder drains, and its cache affinity is lost.
            "behavior": {
                "scaleDown": {
                    "stabilizationWindowSeconds": 300,
                    "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}],
                }
            },
        },
    }


def _store(desc: StackDescription) -> list[dict[str, Any]]:
    store = desc["cache"]["store"]
    master = {
        "name": STORE_MASTER,
        "image": desc["image"],
        "command": [
            "mooncake_master",
            "--rpc_address=0.0.0.0",
            f"--rpc_port={store['master_port']}",
            "--metrics_host=0.0.0.0",
            f"--metrics_port={store['metrics_port']}",
            "--rpc_thread_num=2",
            "--logtostderr",
        ],
        "ports": [
            {"name": "rpc", "containerPort": store["master_port"], "protocol": "TCP"},
            {"name": "admin", "containerPort": store["metrics_port"], "protocol": "TCP"},
        ],
        "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "256Mi"}},
        "readinessProbe": {"httpGet": {"path": "/health", "port": "admin"}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/health", "port": "admin"}, "periodSeconds": 10, "failureThreshold": 6},
        "securityContext": _container_security(),
    }
    holder_memory = f"{store['memory_mib'] + 128}Mi"
    holder = {
        "name": STORE_HOLDER,
        "image": desc["image"],
        "command": [
            "mooncake_client",
            "--host=$(POD_IP)",
            f"--port={store['holder_port']}",
            f"--master_server_address={service_host(desc, STORE_MASTER)}:{store['master_port']}",
            "--metadata_server=P2PHANDSHAKE",
            "--protocol=tcp",
            f"--global_segment_size={store['memory_mib'] << 20}",
            "--local_buffer_size=16MB",
            "--threads=1",
            "--logtostderr",
        ],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [{"name": "transfer", "containerPort": store["holder_port"], "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "250m", "memory": holder_memory}, "limits": {"memory": holder_memory}},
        "livenessProbe": {"tcpSocket": {"port": "transfer"}, "periodSeconds": 10, "failureThreshold": 6},
        "securityContext": _container_security(),
    }
    docs: list[dict[str, Any]] = []
    for name, container in ((STORE_MASTER, master), (STORE_HOLDER, holder)):
        docs.append(
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {"name": name_of(name), "labels": labels(name, desc.name)},
                "spec": {
                    "replicas": 1,
                    # A master keeps nothing across restarts: never two at once, no surge.
                    "strategy": {"type": "Recreate"},
                    "selector": selector(name),
                    "template": {
                        "metadata": {"labels": labels(name, desc.name)},
                        "spec": {
                            "serviceAccountName": SERVICE_ACCOUNT,
                            "automountServiceAccountToken": False,
                            "securityContext": _pod_security(),
                            "containers": [container],
                        },
                    },
                },
            }
        )
    docs.append(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": name_of(STORE_MASTER), "labels": labels(STORE_MASTER, desc.name)},
            "spec": {
                "selector": labels(STORE_MASTER),
                "ports": [{"name": "rpc", "port": store["master_port"], "targetPort": "rpc", "protocol": "TCP"}],
            },
        }
    )
    return docs


def role_documents(desc: StackDescription, role: Role) -> list[dict[str, Any]]:
    docs = [_config_map(desc, role.name), _deployment(desc, role), _service(desc, role)]
    if role.replicas > 1 or (role.autoscale is not None and role.autoscale.min_replicas > 1):
        docs.append(_disruption_budget(desc, role))
    if role.autoscale is not None:
        docs.append(_autoscaler(desc, role))
    return docs


def dump(docs: list[dict[str, Any]], source: str) -> str:
    body = "---\n".join(yaml.safe_dump(doc, sort_keys=False, width=120) for doc in docs)
    return HEADER.format(source=source) + body


def base_files() -> dict[str, str]:
    """deploy/k8s/base: the same for every stack."""
    account = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": SERVICE_ACCOUNT, "labels": {"app.kubernetes.io/name": PART_OF}},
        # EPD never calls the Kubernetes API: no credentials in its pods.
        "automountServiceAccountToken": False,
    }
    internal = ["encoder", "prefill", "decode", "pd", STORE_MASTER, STORE_HOLDER]  # not router, colocated
    policy = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "epd-internal", "labels": {"app.kubernetes.io/name": PART_OF}},
        "spec": {
            # Internal roles take traffic from EPD pods only (gRPC, UCX's TCP lanes, the store),
            # and kubelet probes (which come from the node, not subject to this policy on most CNIs).
            "podSelector": {
                "matchExpressions": [
                    {"key": "app.kubernetes.io/component", "operator": "In", "values": internal},
                    {"key": "app.kubernetes.io/name", "operator": "In", "values": [PART_OF]},
                ]
            },
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": PART_OF}}}]}],
        },
    }
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": ["serviceaccount.yaml", "networkpolicy.yaml"],
    }
    source = "libs/launch/k8s.py (base)"
    return {
        "kustomization.yaml": dump([kustomization], source),
        "serviceaccount.yaml": dump([account], source),
        "networkpolicy.yaml": dump([policy], source),
    }


def overlay_files(desc: StackDescription, source: str) -> dict[str, str]:
    """deploy/k8s/overlays/<name>: one file per role (and the store), plus the kustomization; a
    door in the router's process is part of the router's."""
    roles = [role for role in desc.roles.values() if not (role.name == DOOR and desc.door_in_router)]
    files = {f"{component(role.name)}.yaml": dump(role_documents(desc, role), source) for role in roles}
    if desc.store_enabled:
        files["store.yaml"] = dump(_store(desc), source)
    # The stack's own namespace (docs/deploy.md), created by the same `kubectl apply -k`.
    namespace = {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": desc["kubernetes"]["namespace"], "labels": {"app.kubernetes.io/name": PART_OF}},
    }
    files["namespace.yaml"] = dump([namespace], source)
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": desc["kubernetes"]["namespace"],
        "resources": ["../../base", *sorted(files)],
    }
    files["kustomization.yaml"] = dump([kustomization], source)
    return files


def render(descriptions: list[StackDescription], root: Path) -> dict[Path, str]:
    """Every file under `root` (deploy/k8s) for these descriptions, by path. Stacks that would
    share an overlay directory or a namespace are refused: every stack's objects have the same
    names, so one would overwrite the other's."""
    keys: dict[str, Callable[[StackDescription], str]] = {
        "name": lambda d: d.name,
        "kubernetes.namespace": lambda d: str(d["kubernetes"]["namespace"]),
    }
    for field, key in keys.items():
        seen: dict[str, StackDescription] = {}
        for desc in descriptions:
            if (other := seen.setdefault(key(desc), desc)) is not desc:
                raise DescriptionError(
                    f"{_relative(other.source)} and {_relative(desc.source)} have the same {field} {key(desc)!r}: "
                    f"one stack's objects would overwrite the other's; give each its own {field}"
                )
    out = {root / "base" / name: text for name, text in base_files().items()}
    for desc in descriptions:
        source = _relative(desc.source)
        for name, text in overlay_files(desc, source).items():
            out[root / "overlays" / desc.name / name] = text
    return out


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def documents(text: str) -> Iterator[dict[str, Any]]:
    for doc in yaml.safe_load_all(text):
        if doc is not None:
            yield doc
