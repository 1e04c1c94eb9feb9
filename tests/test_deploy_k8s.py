"""k8s/: `kubectl kustomize` renders the base and every overlay; the objects validate against the
Kubernetes OpenAPI schemas (kubernetes-validate, strict) and keep the deployment's invariants.
checkov runs on the same renderings in tests/test_deploy_checkov.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from test_deploy_support import REPO, find, k8s_env, kustomize_status, render_kustomize

import speedtronic
from speedtronic.config import resolve_config

K8S_VERSION = "1.31.0"
TARGETS = ["k8s", "k8s/overlays/gpu", "k8s/overlays/hub", "k8s/overlays/monitoring"]

pytestmark = pytest.mark.skipif(
    kustomize_status()[0] is None,
    reason=kustomize_status()[1],
)

_RENDERED: dict[str, list[dict]] = {}


def rendered(target: str) -> list[dict]:
    if target not in _RENDERED:
        _RENDERED[target] = render_kustomize(target)
    return _RENDERED[target]


def workloads(objects: list[dict]) -> list[dict]:
    return [
        find(objects, "Deployment", "speedtronic-master"),
        find(objects, "StatefulSet", "speedtronic-worker"),
    ]


def container(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("target", TARGETS)
def test_renders_and_validates_against_kubernetes_schemas(target):
    objects = rendered(target)
    assert objects
    for obj in objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: checked by test_monitoring_overlay_adds_a_service_monitor
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "speedtronic", obj["metadata"]["name"]


@pytest.mark.parametrize("target", TARGETS)
def test_the_config_map_is_configs_itself(target):
    """One configs/ directory: the generated ConfigMap holds exactly configs/*.yaml, byte for
    byte (configs/kustomization.yml generates it; no copy under k8s/ to drift)."""
    assert not (REPO / "k8s/base/configs").exists()
    configmap = find(rendered(target), "ConfigMap")
    assert configmap["metadata"]["name"].startswith("speedtronic-config-")
    shipped = {p.name: p.read_text() for p in (REPO / "configs").glob("*.yaml")}
    assert configmap["data"] == shipped


def test_base_deploys_master_workers_volume_and_services():
    objects = rendered("k8s")
    pvc = find(objects, "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    master = find(objects, "Deployment", "speedtronic-master")
    assert master["spec"]["replicas"] == 1 and master["spec"]["strategy"]["type"] == "Recreate"
    worker = find(objects, "StatefulSet", "speedtronic-worker")
    assert worker["spec"]["replicas"] >= 2
    env = k8s_env(container(worker), "speedtronic-worker-1")
    assert env["SPEEDTRONIC_NODE_ID"] == "speedtronic-worker-1"
    assert env["SPEEDTRONIC_RUN__OUTPUT_DIR"] == "/data/runs/speedtronic-worker-1"
    assert env["SPEEDTRONIC_DISTRIBUTED__CACHE_DIR"] == "/data/runs/speedtronic-worker-1/hub-cache"
    # The config's relative paths (events, checkpoints, DiLoCo state) follow the output dir.
    assert "SPEEDTRONIC_LOGGING__JSON_FILE" not in env
    config_file = REPO / "configs" / env["SPEEDTRONIC_CONFIG"].removeprefix("/config/")
    config = resolve_config(config_file, environ=env, secrets_dir=REPO / "no-such-dir").config
    root = Path("/data/runs/speedtronic-worker-1")
    assert config.events_path == root / "events.jsonl"
    assert root in config.checkpoint_dir.parents and root in config.state_dir.parents
    node_ref = next(e for e in container(worker)["env"] if e["name"] == "SPEEDTRONIC_NODE_ID")
    assert node_ref["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    configmap = find(objects, "ConfigMap")
    for workload in (master, worker):
        env = k8s_env(container(workload), "pod")
        assert env["SPEEDTRONIC_DISTRIBUTED__REPO_ID"] == "file:///data/exchange"
        assert env["SPEEDTRONIC_CONFIG"].removeprefix("/config/") in configmap["data"]
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        assert volumes["data"]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
        assert volumes["config"]["configMap"]["name"] == configmap["metadata"]["name"]
    services = [o for o in objects if o["kind"] == "Service"]
    assert {s["metadata"]["name"] for s in services} == {"speedtronic-master", "speedtronic-worker"}
    assert worker["spec"]["serviceName"] == "speedtronic-worker"
    for service in services:
        annotations = service["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == "8000"
        assert service["spec"]["ports"][0]["port"] == 8000


@pytest.mark.parametrize("target", TARGETS)
def test_pods_are_locked_down_probed_and_sized(target):
    for workload in workloads(rendered(target)):
        spec = workload["spec"]["template"]["spec"]
        main = container(workload)
        assert spec["securityContext"]["runAsNonRoot"] is True
        security = main["securityContext"]
        assert security["allowPrivilegeEscalation"] is False
        assert security["readOnlyRootFilesystem"] is True
        assert security["capabilities"]["drop"] == ["ALL"]
        mounts = {m["mountPath"]: m for m in main["volumeMounts"]}
        assert {"/data", "/tmp", "/config"} <= set(mounts)
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert "emptyDir" in volumes[mounts["/tmp"]["name"]]
        assert mounts["/config"]["readOnly"] is True
        assert main["ports"][0]["containerPort"] == 8000
        assert main["startupProbe"]["httpGet"]["path"] == "/healthz"
        assert main["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert main["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert main["resources"]["requests"] and main["resources"]["limits"]
        assert spec["terminationGracePeriodSeconds"] >= 60
        token_mount = mounts["/run/secrets"]
        assert token_mount["readOnly"] is True
        assert volumes[token_mount["name"]]["secret"]["secretName"] == "speedtronic-hf-token"
        names = [e["name"] for e in main["env"]]
        assert "HF_TOKEN" not in names and "SPEEDTRONIC_DISTRIBUTED__TOKEN" not in names


@pytest.mark.parametrize("target", TARGETS)
def test_no_token_is_committed(target):
    for obj in rendered(target):
        assert obj["kind"] != "Secret", "a Secret in the rendered output would carry a literal"
    for path in (REPO / "k8s").rglob("*"):
        if path.is_file():
            assert "hf_" not in path.read_text().replace("hf_token", ""), path


def test_gpu_overlay_requests_gpus_on_gpu_nodes():
    master, worker = workloads(rendered("k8s/overlays/gpu"))
    for workload in (master, worker):
        spec = workload["spec"]["template"]["spec"]
        assert spec["nodeSelector"]
        assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
        assert k8s_env(container(workload), "pod")["SPEEDTRONIC_RUN__DEVICE"] == "cuda"
    # the master aggregates on one GPU; a worker pod is a node of 8 GPUs, one rank per GPU
    assert container(master)["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "SPEEDTRONIC_RUN__NPROC_PER_NODE" not in k8s_env(container(master), "pod")
    resources = container(worker)["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == "8"
    assert k8s_env(container(worker), "pod")["SPEEDTRONIC_RUN__NPROC_PER_NODE"] == "auto"
    mounts = {m["name"]: m["mountPath"] for m in container(worker)["volumeMounts"]}
    volumes = {v["name"]: v for v in worker["spec"]["template"]["spec"]["volumes"]}
    assert mounts["dshm"] == "/dev/shm" and volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert {"data", "config", "tmp"} <= set(mounts)  # the base's mounts are kept


def test_hub_overlay_switches_transport_and_requires_the_token_secret():
    for workload in workloads(rendered("k8s/overlays/hub")):
        env = k8s_env(container(workload), "pod")
        repo = env["SPEEDTRONIC_DISTRIBUTED__REPO_ID"]
        assert not repo.startswith("file://") and repo.count("/") == 1
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        assert volumes["hf-token"]["secret"]["optional"] is False
    example = yaml.safe_load((REPO / "k8s/overlays/hub/hf-token-secret.example.yaml").read_text())
    assert example["kind"] == "Secret" and "hf_token" in example["stringData"]
    kubernetes_validate.validate(example, K8S_VERSION, strict=True)


def test_monitoring_overlay_adds_a_service_monitor():
    objects = rendered("k8s/overlays/monitoring")
    monitor = find(objects, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selector = monitor["spec"]["selector"]["matchLabels"]
    services = [o for o in objects if o["kind"] == "Service"]
    for service in services:
        labels = service["metadata"]["labels"]
        assert all(labels.get(k) == v for k, v in selector.items()), service["metadata"]["name"]
        assert service["spec"]["ports"][0]["name"] == monitor["spec"]["endpoints"][0]["port"]
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == ["speedtronic"]


@pytest.mark.parametrize("target", TARGETS)
def test_network_policy_admits_only_the_metrics_port(target):
    objects = rendered(target)
    policy = find(objects, "NetworkPolicy")
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    selector = spec["podSelector"]["matchLabels"]
    for workload in workloads(objects):  # every pod of the run is selected
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert all(labels.get(k) == v for k, v in selector.items()), workload["metadata"]["name"]
    [rule] = spec["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": "metrics"}]
    for workload in workloads(objects):
        ports = {p["name"]: p["containerPort"] for p in container(workload)["ports"]}
        assert ports == {"metrics": 8000}
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert container(workload)[probe]["httpGet"]["port"] == "metrics"
    services = [o for o in objects if o["kind"] == "Service"]
    assert all(s["spec"]["ports"][0]["targetPort"] == "metrics" for s in services)


def test_image_is_the_package_version_and_overridable_with_kustomize_images(tmp_path):
    for workload in workloads(rendered("k8s")):
        assert container(workload)["image"] == f"speedtronic:{speedtronic.__version__}"
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    digest = "sha256:" + "ab" * 32
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [os.path.relpath(REPO / "k8s/overlays/gpu", overlay)],
                "images": [{"name": "speedtronic", "newName": "reg.example/sp", "digest": digest}],
            }
        )
    )
    for workload in workloads(render_kustomize(str(overlay))):
        assert container(workload)["image"] == f"reg.example/sp@{digest}"
