"""deploy/k8s: each manifest against the Kubernetes schemas (strict), then how they fit together."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from ._support import (
    AGENTS_YAML,
    EXAMPLE_MANIFESTS,
    K8S,
    K8S_VERSION,
    REDIS_CONF,
    k8s_documents,
    k8s_manifest_files,
    k8s_object,
    load_yaml,
    parse_redis_conf,
    size_bytes,
)

DOCS = k8s_documents()
WORKLOADS = [(p, d) for p, d in DOCS if d["kind"] in ("Deployment", "StatefulSet")]
CALLGATE_WORKLOADS = [(p, d) for p, d in WORKLOADS if d["metadata"]["name"] != "callgate-redis"]


def _ids(items: list[tuple[Path, dict[str, Any]]]) -> list[str]:
    return [f"{p.name}:{d['kind']}/{d['metadata']['name']}" for p, d in items]


def _pod(workload: dict[str, Any]) -> dict[str, Any]:
    pod: dict[str, Any] = workload["spec"]["template"]["spec"]
    return pod


def _container(workload: dict[str, Any]) -> dict[str, Any]:
    containers = _pod(workload)["containers"]
    assert len(containers) == 1
    container: dict[str, Any] = containers[0]
    return container


# -- schemas ------------------------------------------------------------------------------------
def test_kubernetes_validate_knows_the_version() -> None:
    assert K8S_VERSION in {v.rsplit(".", 1)[0] for v in kubernetes_validate.utils.all_versions()}


@pytest.mark.parametrize(("path", "doc"), DOCS, ids=_ids(DOCS))
def test_manifest_matches_kubernetes_schema(path: Path, doc: dict[str, Any]) -> None:
    """Strict schemas: an unknown or misspelt field is an error, as `kubectl --validate=strict`."""
    try:
        got = kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{path.name}: {exc.caught.json_path}: {exc.caught.message}")
    assert got == K8S_VERSION


def test_no_namespace() -> None:
    """Namespace-less: `kubectl -n NAME apply -k` or an overlay picks it."""
    for path, doc in DOCS:
        assert "namespace" not in doc["metadata"], path.name


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: _container(d).update(readinesProbe={}),  # a typo
        lambda d: d["spec"].update(replicas="2"),  # a string
        lambda d: _container(d)["resources"]["limits"].update(cpu=[1]),  # a list
    ],
    ids=["unknown-field", "string-replicas", "bad-quantity"],
)
def test_strict_schema_rejects_broken_manifests(mutate: Any) -> None:
    """The validation above is live: typical mistakes are refused."""
    doc = copy.deepcopy(k8s_object("Deployment", "callgate-gateway"))
    mutate(doc)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


# -- kustomization ------------------------------------------------------------------------------
def test_kustomization_lists_every_manifest_but_the_examples() -> None:
    kustomization = load_yaml(K8S / "kustomization.yaml")
    assert kustomization["kind"] == "Kustomization"
    listed = kustomization["resources"]
    assert len(listed) == len(set(listed))
    files = {p.name for p in k8s_manifest_files()}
    assert set(listed) == files - EXAMPLE_MANIFESTS
    assert EXAMPLE_MANIFESTS <= files
    images = {i["name"] for i in kustomization["images"]}
    for _, doc in WORKLOADS:
        for c in _pod(doc)["containers"]:
            if c["image"].startswith("callgate:"):
                assert "callgate" in images


# -- wiring -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("path", "doc"), WORKLOADS, ids=_ids(WORKLOADS))
def test_selector_matches_template_labels(path: Path, doc: dict[str, Any]) -> None:
    selector = doc["spec"]["selector"]["matchLabels"]
    labels = doc["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items(), path.name


def _selects(selector: dict[str, str]) -> list[dict[str, Any]]:
    return [
        d
        for _, d in WORKLOADS
        if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
    ]


def test_services_select_a_workload_and_its_ports() -> None:
    for _, svc in [(p, d) for p, d in DOCS if d["kind"] == "Service"]:
        targets = _selects(svc["spec"]["selector"])
        assert len(targets) == 1, f"Service {svc['metadata']['name']} selects {len(targets)}"
        names = {p["name"] for p in _container(targets[0]).get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in names, (svc["metadata"]["name"], port)


def test_gateway_service() -> None:
    svc = k8s_object("Service", "callgate-gateway")
    assert svc["spec"]["sessionAffinity"] == "None", "each call is one WebSocket: no affinity"
    assert [(p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [(80, "http")]
    ports = _container(k8s_object("Deployment", "callgate-gateway"))["ports"]
    assert [(p["name"], p["containerPort"]) for p in ports] == [("http", 8080)]


def test_redis_service_is_headless_for_the_statefulset() -> None:
    svc = k8s_object("Service", "callgate-redis")
    sts = k8s_object("StatefulSet", "callgate-redis")
    assert svc["spec"]["clusterIP"] == "None"
    assert sts["spec"]["serviceName"] == "callgate-redis"
    claims = sts["spec"]["volumeClaimTemplates"]
    assert [c["metadata"]["name"] for c in claims] == ["data"]
    mounts = {m["name"]: m["mountPath"] for m in _container(sts)["volumeMounts"]}
    assert mounts["data"] == "/data"


@pytest.mark.parametrize(("path", "doc"), WORKLOADS, ids=_ids(WORKLOADS))
def test_references_resolve(path: Path, doc: dict[str, Any]) -> None:
    """ConfigMaps, Secrets, volumes and named probe ports that a workload uses exist."""
    configmaps = {d["metadata"]["name"] for _, d in DOCS if d["kind"] == "ConfigMap"}
    secrets = {d["metadata"]["name"] for _, d in DOCS if d["kind"] == "Secret"}
    pod = _pod(doc)
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    claims = {c["metadata"]["name"] for c in doc["spec"].get("volumeClaimTemplates", [])}
    for volume in volumes.values():
        if "configMap" in volume:
            assert volume["configMap"]["name"] in configmaps, volume
    container = _container(doc)
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            assert source["configMapRef"]["name"] in configmaps, source
        if "secretRef" in source:
            assert source["secretRef"]["name"] in secrets, source
    for mount in container.get("volumeMounts", []):
        assert mount["name"] in volumes or mount["name"] in claims, mount
    port_names = {p["name"] for p in container.get("ports", [])}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        spec = container.get(probe, {})
        for action in ("httpGet", "tcpSocket"):
            if action in spec and isinstance(spec[action]["port"], str):
                assert spec[action]["port"] in port_names, (probe, spec)


@pytest.mark.parametrize(("path", "doc"), CALLGATE_WORKLOADS, ids=_ids(CALLGATE_WORKLOADS))
def test_args_variables_are_defined(path: Path, doc: dict[str, Any]) -> None:
    """`$(VAR)` in args is expanded by Kubernetes only if the container defines VAR; an
    undefined one would reach callgate literally."""
    env = k8s_object("ConfigMap", "callgate-env")["data"]
    container = _container(doc)
    defined = set(env) | {e["name"] for e in container.get("env", [])}
    for arg in container["args"]:
        for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg):
            assert var in defined, f"{path.name}: $({var}) not defined"


def test_gateway_and_worker_commands() -> None:
    gw = _container(k8s_object("Deployment", "callgate-gateway"))
    worker = _container(k8s_object("Deployment", "callgate-worker"))
    assert gw["args"] == ["serve", "--redis", "$(CALLGATE_REDIS_URL)", "--no-worker"]
    assert worker["args"] == ["worker", "--redis", "$(CALLGATE_REDIS_URL)", "--metrics-port",
                              "9090", "--drain-timeout", "10"]
    assert worker["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert {"name": "metrics", "containerPort": 9090, "protocol": "TCP"} in worker["ports"]
    assert "command" not in gw and "command" not in worker, "the image's ENTRYPOINT is callgate"
    env = k8s_object("ConfigMap", "callgate-env")["data"]
    assert env["CALLGATE_REDIS_URL"].startswith("redis://callgate-redis:6379/")


def test_replicas() -> None:
    assert k8s_object("Deployment", "callgate-gateway")["spec"]["replicas"] == 2
    assert k8s_object("Deployment", "callgate-worker")["spec"]["replicas"] == 2
    assert k8s_object("StatefulSet", "callgate-redis")["spec"]["replicas"] == 1


# -- gateway lifecycle --------------------------------------------------------------------------
def test_gateway_probes() -> None:
    c = _container(k8s_object("Deployment", "callgate-gateway"))
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["startupProbe"]["httpGet"]["path"] == "/healthz"
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 60, "time to load models"


def test_gateway_grace_period_covers_prestop_and_drain() -> None:
    gw = k8s_object("Deployment", "callgate-gateway")
    drain = float(load_yaml(AGENTS_YAML)["server"]["drain_timeout_s"])
    pre_stop = _container(gw)["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    sleep = float(pre_stop[1])
    grace = _pod(gw)["terminationGracePeriodSeconds"]
    assert grace > sleep + drain, f"grace {grace} <= preStop {sleep} + drain {drain}"
    # The preStop must end well before the drain starts being cut short.
    assert 0 < sleep <= 15
    strategy = gw["spec"]["strategy"]["rollingUpdate"]
    assert strategy["maxUnavailable"] == 0


def test_worker_grace_period_covers_its_drain() -> None:
    """SIGTERM: the worker's calls go on for --drain-timeout, then are handed back; the kubelet
    must not SIGKILL it before (a killed worker's calls wait out their lease instead)."""
    from gateway.cli import build_parser

    worker = k8s_object("Deployment", "callgate-worker")
    args = build_parser().parse_args(_container(worker)["args"])
    grace = _pod(worker)["terminationGracePeriodSeconds"]
    assert grace >= args.drain_timeout + 10, (grace, args.drain_timeout)
    assert "lifecycle" not in _container(worker), "a worker takes no Service traffic to drain"
    assert worker["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_gateway_readiness_fails_at_once_on_drain() -> None:
    """/readyz fails as the drain starts: one failed probe takes the pod out of the Service."""
    probe = _container(k8s_object("Deployment", "callgate-gateway"))["readinessProbe"]
    assert probe["httpGet"]["path"] == "/readyz" and probe["failureThreshold"] == 1


def test_gateway_resources() -> None:
    res = _container(k8s_object("Deployment", "callgate-gateway"))["resources"]
    for part in ("requests", "limits"):
        assert str(res[part]["cpu"]) == "1"
        assert size_bytes(res[part]["memory"]) == 1024**3


@pytest.mark.parametrize("component", ["gateway", "worker"])
def test_pdb_targets_its_deployment_one_pod_at_a_time(component: str) -> None:
    pdb = k8s_object("PodDisruptionBudget", f"callgate-{component}")
    targets = _selects(pdb["spec"]["selector"]["matchLabels"])
    assert [t["metadata"]["name"] for t in targets] == [f"callgate-{component}"]
    assert pdb["spec"]["maxUnavailable"] == 1
    assert targets[0]["spec"]["replicas"] >= 2, "a PDB over one pod blocks every node drain"


def test_worker_hpa_targets_what_exists() -> None:
    hpa = k8s_object("HorizontalPodAutoscaler", "callgate-worker")
    ref = hpa["spec"]["scaleTargetRef"]
    worker = k8s_object(ref["kind"], ref["name"])
    assert worker["apiVersion"] == ref["apiVersion"]
    assert hpa["spec"]["minReplicas"] >= 1
    assert "requests" in _container(worker)["resources"], "CPU utilisation needs a request"


# -- security -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("path", "doc"), WORKLOADS, ids=_ids(WORKLOADS))
def test_non_root_read_only(path: Path, doc: dict[str, Any]) -> None:
    pod = _pod(doc)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["automountServiceAccountToken"] is False
    sc = _container(doc)["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    for c in pod["containers"]:
        image, _, tag = c["image"].rpartition(":")
        assert image and tag and tag != "latest", f"{path.name}: pin the image tag: {c['image']}"


@pytest.mark.parametrize(("path", "doc"), CALLGATE_WORKLOADS, ids=_ids(CALLGATE_WORKLOADS))
def test_callgate_pods_use_the_image_user_and_writable_tmp(path: Path, doc: dict[str, Any]) -> None:
    pod = _pod(doc)
    assert pod["securityContext"]["runAsUser"] == 10001, "the image's USER (deploy/Dockerfile)"
    container = _container(doc)
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    tmp = [v for v in pod["volumes"] if v["name"] == mounts["/tmp"]["name"]]
    assert "emptyDir" in tmp[0], "a read-only root filesystem needs a writable /tmp"
    # The config as a directory: a subPath mount never sees ConfigMap updates (no reload).
    config = mounts["/etc/callgate"]
    assert config["readOnly"] is True and "subPath" not in config
    env = k8s_object("ConfigMap", "callgate-env")["data"]
    assert env["CALLGATE_CONFIG"] == "/etc/callgate/agents.yaml"
    assert [e["secretRef"]["name"] for e in container["envFrom"] if "secretRef" in e] == [
        "callgate-secrets"
    ]
    # The Secret last: a key in both (a Redis URL with a password) takes the Secret's value.
    assert "secretRef" in container["envFrom"][-1]


def test_secret_example_holds_no_secret() -> None:
    secret = k8s_object("Secret", "callgate-secrets")
    values = secret["stringData"]
    assert {"TWILIO_AUTH_TOKEN", "CALLGATE_TOKEN_SECRET"} <= set(values)
    assert all(v == "" for v in values.values()), "placeholders only: every value empty"
    assert "data" not in secret


def test_redis_memory_fits_its_limit() -> None:
    sts = k8s_object("StatefulSet", "callgate-redis")
    limit = size_bytes(_container(sts)["resources"]["limits"]["memory"])
    maxmemory = size_bytes(parse_redis_conf(REDIS_CONF)["maxmemory"][0])
    assert maxmemory < 0.8 * limit, "room for the fork of an AOF rewrite"
    assert _container(sts)["args"] == ["redis-server", "/etc/redis/redis.conf"]


def test_public_url_is_https() -> None:
    env = k8s_object("ConfigMap", "callgate-env")["data"]
    assert env["CALLGATE_PUBLIC_URL"].startswith("https://"), "Twilio needs https and wss"
    assert env["CALLGATE_VALIDATE_SIGNATURES"] == "true"
