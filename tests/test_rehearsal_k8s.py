"""Rehearse the rendered k8s/ manifests without a cluster: the master Deployment's pod and two
worker StatefulSet pods run as local processes with exactly their container's command and env
(fieldRefs and $(VAR) expanded as the kubelet does; the image's ENV and ENTRYPOINT from the
Dockerfile), the PVC shared as one temporary directory, the generated ConfigMap written out as
files, emptyDir/secret volumes as per-pod temporary directories, and the pod names as node ids.
The pods' own startup, liveness and readiness probes must answer 200.
"""

from __future__ import annotations

import json
import secrets as secrets_module
import signal
import statistics
from pathlib import Path

import pytest
from test_deploy_support import find, image_config, k8s_env, kustomize_status, render_kustomize
from test_rehearsal_support import (
    SMALL_MODEL_ENV,
    SPEED_ENV,
    Rehearsal,
    base_env,
    free_port,
    http_get,
    rehearse,
    rewrite_paths,
    wait_until,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        kustomize_status()[0] is None,
        reason=kustomize_status()[1],
    ),
]


def pod_process(
    objects: list[dict],
    workload: dict,
    pod_name: str,
    tmp: Path,
    secrets: dict[str, dict[str, str]] | None = None,
) -> Rehearsal:
    """One pod of `workload` as a local process; `secrets` holds the cluster's Secrets (name ->
    data), as `kubectl create secret` would have made them."""
    spec = workload["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    image = image_config()
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts: dict[str, str] = {}
    for mount in container["volumeMounts"]:
        volume = volumes[mount["name"]]
        if "persistentVolumeClaim" in volume:
            local = tmp / "pvc" / volume["persistentVolumeClaim"]["claimName"]
            local.mkdir(parents=True, exist_ok=True)
        elif "configMap" in volume:
            configmap = find(objects, "ConfigMap", volume["configMap"]["name"])
            local = tmp / pod_name / "configmap"
            local.mkdir(parents=True, exist_ok=True)  # a pod started again: the same files
            for key, text in configmap["data"].items():
                (local / key).write_text(text)
        elif "secret" in volume:
            data = (secrets or {}).get(volume["secret"]["secretName"])
            assert data is not None or volume["secret"].get("optional"), "missing Secret"
            local = tmp / pod_name / "secret"  # empty when the optional Secret does not exist
            local.mkdir(parents=True, exist_ok=True)
            for key, text in (data or {}).items():
                (local / key).write_text(text)
        else:
            assert "emptyDir" in volume, volume
            local = tmp / pod_name / mount["name"]
            local.mkdir(parents=True, exist_ok=True)
        mounts[mount["mountPath"]] = str(local)
    port = free_port()
    env = base_env(tmp)
    for key, value in image["env"].items():
        if key != "PATH":
            env[key] = rewrite_paths(value, mounts)
    for key, value in k8s_env(container, pod_name).items():
        env[key] = rewrite_paths(value, mounts)
    env.update(SPEED_ENV)
    env["HOSTNAME"] = pod_name
    env["TMPDIR"] = mounts["/tmp"]
    env["SPEEDTRONIC_SECRETS_DIR"] = mounts["/run/secrets"]
    env["SPEEDTRONIC_METRICS__PORT"] = str(port)  # the pod's own network namespace
    argv = container.get("command") or image["entrypoint"]
    argv = [*argv, *(container.get("args") or ([] if container.get("command") else image["cmd"]))]
    argv = [rewrite_paths(a, mounts) for a in argv]
    cwd = rewrite_paths(container.get("workingDir") or image["workdir"], mounts)
    proc = Rehearsal(pod_name, argv, env, cwd, port, mounts)
    proc.container = container
    return proc


def test_k8s_master_and_two_workers_complete_a_round_and_stop_cleanly(tmp_path):
    objects = render_kustomize("k8s")
    master = find(objects, "Deployment", "speedtronic-master")
    workers = find(objects, "StatefulSet", "speedtronic-worker")
    assert workers["spec"]["replicas"] >= 2
    processes = [pod_process(objects, master, "speedtronic-master-7c9d-x2k4p", tmp_path)]
    processes += [
        pod_process(objects, workers, f"speedtronic-worker-{i}", tmp_path) for i in (0, 1)
    ]
    pvc = Path(processes[0].mounts["/data"])
    for proc in processes:
        assert proc.env["SPEEDTRONIC_DISTRIBUTED__REPO_ID"] == (pvc / "exchange").as_uri()
        assert proc.mounts["/data"] == str(pvc)

    def probe(proc: Rehearsal) -> None:
        ports = {p["name"]: p["containerPort"] for p in proc.container["ports"]}
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            get = proc.container[kind]["httpGet"]
            assert ports[get["port"]] == 8000
            status, body = http_get(proc.url(get["path"]))
            assert status == 200, (proc.name, kind, body)

    rehearse(processes, tmp_path, probe)
    published = {p.name for p in (pvc / "exchange" / "nodes").iterdir()}
    assert {"speedtronic-worker-0", "speedtronic-worker-1"} <= published, published
    for name in ("speedtronic-worker-0", "speedtronic-worker-1"):
        assert list((pvc / "runs" / name).rglob("latest.json")), name


def test_k8s_hub_overlay_reads_the_token_from_the_mounted_secret(tmp_path):
    """overlays/hub against the Hub emulator, which demands the token; the Secret is created as
    `kubectl create secret generic speedtronic-hf-token --from-file=hf_token=...` would."""
    from speedtronic.testing.hub_server import HubEmulator

    token = "hf_k8s_" + secrets_module.token_hex(8)
    objects = render_kustomize("k8s/overlays/hub")
    master = find(objects, "Deployment", "speedtronic-master")
    workers = find(objects, "StatefulSet", "speedtronic-worker")
    cluster_secrets = {"speedtronic-hf-token": {"hf_token": token}}
    with HubEmulator(token=token) as hub:
        processes = [
            pod_process(objects, master, "speedtronic-master-0", tmp_path, cluster_secrets),
            pod_process(objects, workers, "speedtronic-worker-0", tmp_path, cluster_secrets),
        ]
        repo = processes[0].env["SPEEDTRONIC_DISTRIBUTED__REPO_ID"]
        for proc in processes:
            assert token not in " ".join(proc.env.values())
            proc.env.update(SMALL_MODEL_ENV)
            proc.env["HF_ENDPOINT"] = hub.url  # the cluster's route to the Hub

        def probe(proc: Rehearsal) -> None:
            assert token not in http_get(proc.url("/metrics"))[1]

        rehearse(processes, tmp_path, probe)
        assert any(path.startswith("nodes/speedtronic-worker-0/") for path in hub.files(repo))
    for proc in processes:
        assert token not in proc.output(), f"{proc.name} logged the token"


def _events(proc: Rehearsal, name: str) -> list[dict]:
    """The ``name`` events in a rehearsed pod's JSON log lines, each with its ``ts``."""
    found = []
    for line in proc.output().splitlines():
        if line.startswith("{") and f'"event": "{name}"' in line:
            row = json.loads(line)
            found.append({**row["fields"], "ts": row["ts"]})
    return found


def test_k8s_worker_statefulset_scaled_3_1_3_mid_run_costs_no_round(tmp_path):
    """Issue 40: `kubectl scale statefulset/speedtronic-worker --replicas=1` mid-run deletes
    pods -1 and -2 at once (podManagementPolicy Parallel: SIGTERM to both); `--replicas=3`
    starts them again under the same names over the same PVC (they resume). No round waits
    for a pod that left, and none for one that came back (the manifests' round_timeout of
    30 s: a round that waited would show). The figures are printed before the assertions."""
    objects = render_kustomize("k8s")
    master = find(objects, "Deployment", "speedtronic-master")
    workers = find(objects, "StatefulSet", "speedtronic-worker")
    names = [f"speedtronic-worker-{i}" for i in range(3)]
    boss = pod_process(objects, master, "speedtronic-master-0", tmp_path)
    pods = {name: pod_process(objects, workers, name, tmp_path) for name in names}
    every = [boss, *pods.values()]

    def rounds_with(nodes: set[str], after: int) -> bool:
        closes = [e for e in _events(boss, "outer_step") if e["outer_step"] > after]
        return any(nodes <= {i.split("/")[0] for i in e["included"]} for e in closes)

    def last() -> int:
        return max([e["outer_step"] for e in _events(boss, "outer_step")] or [0])

    try:
        for proc in every:
            proc.start(tmp_path)
        wait_until(lambda: rounds_with(set(names), 0), 300, "rounds with three workers", every)
        down = last()
        for name in names[1:]:  # scaled to 1: both go at once
            pods[name].process.send_signal(signal.SIGTERM)
        for name in names[1:]:
            assert pods[name].wait(timeout=180) == 0, pods[name].output()[-4000:]
        wait_until(
            lambda: last() >= down + 4, 300, "four rounds of one worker", [boss, pods[names[0]]]
        )
        up = last()
        (tmp_path / "again").mkdir()
        for name in names[1:]:  # scaled to 3 again: the same pods, resumed from the PVC
            pods[name] = pod_process(objects, workers, name, tmp_path).start(tmp_path / "again")
        every = [boss, *pods.values()]
        wait_until(
            lambda: rounds_with(set(names), up), 300, "rounds with three workers again", every
        )
        back = last()
        wait_until(lambda: last() >= back + 2, 120, "two more rounds", every)
        closes = _events(boss, "outer_step")
        after_down = [e for e in closes if down < e["outer_step"] <= up]
        after_up = [e for e in closes if up < e["outer_step"]]
        figures = {
            "round_seconds_before_median": statistics.median(
                e["round_seconds"] for e in closes if e["outer_step"] <= down
            ),
            "round_seconds_after_scale_down": [round(e["round_seconds"], 2) for e in after_down],
            "round_seconds_after_scale_up": [round(e["round_seconds"], 2) for e in after_up],
            "reasons": [e["reason"] for e in after_down + after_up],
            "left": [e["node_id"] for e in _events(boss, "node_left")],
            "first_included": {
                e["node_id"]: e["since_start_s"]
                for e in _events(boss, "node_first_included")
                if e["outer_step"] > up
            },
        }
        print(json.dumps(figures))
        assert sorted(figures["left"]) == names[1:], figures
        assert "timeout" not in figures["reasons"], figures
        assert max(e["round_seconds"] for e in after_down + after_up) < 30, figures
        for proc in every:
            assert proc.terminate(timeout=180) == 0, proc.output()[-4000:]
    finally:
        for proc in every:
            proc.kill()
