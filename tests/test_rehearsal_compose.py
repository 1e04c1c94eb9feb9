"""Rehearse compose.yaml without a container engine: `master` and two `worker` replicas run as
local processes with exactly their service's command and environment (plus the image's ENV and
ENTRYPOINT from the Dockerfile), volumes mapped to temporary directories, the configs bind
mount mapped to configs/, secrets to a temporary /run/secrets, and distinct hostnames.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from test_deploy_support import REPO, compose_env, image_config, load_compose
from test_rehearsal_support import (
    SMALL_MODEL_ENV,
    SPEED_ENV,
    Rehearsal,
    base_env,
    free_port,
    http_get,
    rehearse,
    rewrite_paths,
)

pytestmark = pytest.mark.slow


def service_process(
    model: dict, name: str, hostname: str, tmp: Path, *, replica: str | None = None
) -> Rehearsal:
    """One replica of a compose service as a local process."""
    service = model["services"][name]
    image = image_config()
    label = replica or name
    mounts: dict[str, str] = {}
    for volume in service.get("volumes", []):
        if volume["type"] == "volume":
            local = tmp / "volumes" / volume["source"]  # shared by every service using it
        else:
            local = (REPO / volume["source"]).resolve()
        local.mkdir(parents=True, exist_ok=True)
        mounts[volume["target"]] = str(local)
    secrets_dir = tmp / label / "run-secrets"
    secrets_dir.mkdir(parents=True)
    for secret in service.get("secrets", []):
        source = model["secrets"][secret]["file"]
        (secrets_dir / secret).write_text((tmp / source).read_text())
    mounts.setdefault("/run/secrets", str(secrets_dir))  # unless a volume is mounted there
    port = free_port()
    env = base_env(tmp)
    for key, value in image["env"].items():
        if key != "PATH":
            env[key] = rewrite_paths(value, mounts)
    for key, value in compose_env(service).items():
        env[key] = rewrite_paths(value, mounts)
    env.update(SPEED_ENV)
    env["HOSTNAME"] = hostname
    env["SPEEDTRONIC_SECRETS_DIR"] = mounts["/run/secrets"]  # the container's /run/secrets
    env["SPEEDTRONIC_METRICS__PORT"] = str(port)  # the container's own network namespace
    argv = [rewrite_paths(a, mounts) for a in service.get("entrypoint") or image["entrypoint"]]
    argv += [rewrite_paths(a, mounts) for a in service.get("command") or image["cmd"]]
    output_dir = env.get("SPEEDTRONIC_RUN__OUTPUT_DIR", "")  # may hold {node_id}: a slot
    cwd = rewrite_paths(image["workdir"], mounts)
    return Rehearsal(label, argv, env, cwd, port, mounts, output_dir=output_dir)


def healthcheck_passes(model: dict, name: str, proc: Rehearsal) -> bool:
    """Run the service's compose healthcheck command against the process (port mapped)."""
    test = model["services"][name]["healthcheck"]["test"]
    assert test[0] == "CMD" and test[1] == "python3"
    argv = [sys.executable, *(a.replace(":8000/", f":{proc.port}/") for a in test[2:])]
    return subprocess.run(argv, env=proc.env, capture_output=True, timeout=30).returncode == 0


def test_compose_master_and_two_workers_complete_a_round_and_stop_cleanly(tmp_path):
    model = load_compose()
    master = service_process(model, "master", "master", tmp_path)
    workers = [
        service_process(model, "worker", secrets.token_hex(6), tmp_path, replica=f"worker-{i}")
        for i in (1, 2)
    ]
    assert master.env["SPEEDTRONIC_DISTRIBUTED__REPO_ID"].startswith("file://" + str(tmp_path))
    assert master.env["SPEEDTRONIC_CONFIG"] == str(REPO / "configs/diloco.yaml")
    kinds = {master.name: "master", **{w.name: "worker" for w in workers}}

    def probe(proc: Rehearsal) -> None:
        assert healthcheck_passes(model, kinds[proc.name], proc), proc.name

    rehearse([master, *workers], tmp_path, probe)
    # Node ids are worker slots on the shared volume, not the (random) hostnames: each worker
    # claimed its own and published under it.
    nodes = Path(master.mounts["/data"]) / "exchange" / "nodes"
    published = {p.name for p in nodes.iterdir()}
    assert sorted(w.node_id() for w in workers) == ["worker-1", "worker-2"]
    assert {"worker-1", "worker-2"} <= published, published


def test_compose_hub_override_reads_the_token_from_the_secret_file(tmp_path):
    """compose.yaml + compose.hub.yaml against the Hub emulator, which demands the token that
    only the compose secret file carries. The Hub's address reaches the processes as
    HF_ENDPOINT, which compose.hub.yaml passes through from the caller; the model is shrunk
    for time (documented overrides below)."""
    from speedtronic.testing.hub_server import HubEmulator

    token = "hf_rehearsal_" + secrets.token_hex(8)
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "hf_token").write_text(token + "\n")
    model = load_compose(
        "compose.yaml", "compose.hub.yaml", environ={"SPEEDTRONIC_HUB_REPO": "team/run"}
    )
    # The one-shot `hub-token` service copies the secret for uid 10001 into the volume that
    # master and workers mount at /run/secrets. Its script runs as it is, except that a
    # non-root test cannot give the copy away (chown) — root CI runs it whole.
    copier = service_process(model, "hub-token", "hub-token", tmp_path)
    script = copier.argv[-1] if os.geteuid() == 0 else copier.argv[-1].split(" && chown")[0]
    done = subprocess.run(
        [*copier.argv[:-1], script], env=copier.env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    copy = Path(copier.mounts["/out"]) / "hf_token"
    assert oct(copy.stat().st_mode & 0o777) == "0o400"
    if os.geteuid() == 0:
        assert (copy.stat().st_uid, copy.stat().st_gid) == (10001, 10001)
    with HubEmulator(token=token) as hub:
        master = service_process(model, "master", "master", tmp_path)
        worker = service_process(model, "worker", secrets.token_hex(6), tmp_path, replica="worker")
        for proc in (master, worker):
            assert proc.env["SPEEDTRONIC_DISTRIBUTED__REPO_ID"] == "team/run"
            assert token not in " ".join(f"{k}={v}" for k, v in proc.env.items())
            assert (Path(proc.mounts["/run/secrets"]) / "hf_token").read_text().strip() == token
            proc.env.update(SMALL_MODEL_ENV)
            proc.env["HF_ENDPOINT"] = hub.url

        def probe(proc: Rehearsal) -> None:
            assert token not in http_get(proc.url("/metrics"))[1]

        rehearse([master, worker], tmp_path, probe)
        assert any(path.startswith("nodes/") for path in hub.files("team/run"))
    for proc in (master, worker):
        assert token not in proc.output(), f"{proc.name} logged the token"
