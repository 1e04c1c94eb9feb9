"""compose.yaml and its overrides, validated against the Compose Specification JSON schema.

The schema is vendored in tests/data/compose-spec/ (see the README there: it is the one shipped
in the docker-compose 1.29.2 wheel, Apache-2.0). The rehearsal that runs the services lives
in tests/test_rehearsal_compose.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml
from test_deploy_support import REPO, compose_env, load_compose

from speedtronic.config import resolve_config

SCHEMA = json.loads((REPO / "tests/data/compose-spec/compose_spec.json").read_text())
HUB_ENV = {"SPEEDTRONIC_HUB_REPO": "owner/run"}


def schema_errors(document: dict) -> list[str]:
    validator = jsonschema.Draft201909Validator(SCHEMA)
    return [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(document)]


@pytest.mark.parametrize("name", ["compose.yaml", "compose.gpu.yaml", "compose.hub.yaml"])
def test_each_file_is_valid_compose(name):
    document = yaml.safe_load((REPO / name).read_text())
    assert not schema_errors(document)


@pytest.mark.parametrize(
    "files", [("compose.yaml", "compose.gpu.yaml"), ("compose.yaml", "compose.hub.yaml")]
)
def test_merged_overrides_are_valid_compose(files):
    assert not schema_errors(load_compose(*files, environ=HUB_ENV))


def test_schema_rejects_a_typo():
    assert schema_errors({"services": {"master": {"image": "x", "enviroment": {}}}})


def test_master_and_worker_share_image_volume_and_configs():
    model = load_compose()
    master, worker = model["services"]["master"], model["services"]["worker"]
    assert master["image"] == worker["image"] and master["build"] == worker["build"]
    assert master["build"]["context"] == "." and (REPO / master["build"]["dockerfile"]).exists()
    for service in (master, worker):
        env = compose_env(service)
        assert env["SPEEDTRONIC_DISTRIBUTED__REPO_ID"] == "file:///data/exchange"
        config = env["SPEEDTRONIC_CONFIG"]
        assert config.startswith("/config/")
        assert (REPO / "configs" / config.removeprefix("/config/")).is_file(), config
        volumes = {v["target"]: v for v in service["volumes"]}
        assert volumes["/data"]["type"] == "volume"
        assert volumes["/data"]["source"] in model["volumes"]
        assert volumes["/config"]["source"] == "./configs" and volumes["/config"]["read_only"]
        test = " ".join(service["healthcheck"]["test"])
        assert "/healthz" in test
        assert service["stop_signal"] == "SIGTERM"
    assert compose_env(master)["SPEEDTRONIC_DISTRIBUTED__ROLE"] == "master"
    assert compose_env(worker)["SPEEDTRONIC_DISTRIBUTED__ROLE"] == "worker"


def test_worker_is_scalable_with_slot_node_ids():
    """Replicas differ by nothing but the worker slot they claim on the shared volume."""
    worker = load_compose()["services"]["worker"]
    for fixed in ("container_name", "hostname", "ports", "entrypoint", "command"):
        assert fixed not in worker, f"worker must not set {fixed} (breaks --scale or recreation)"
    env = compose_env(worker)
    assert "SPEEDTRONIC_NODE_ID" not in env and "SPEEDTRONIC_DISTRIBUTED__NODE_ID" not in env
    assert env["SPEEDTRONIC_DISTRIBUTED__SLOTS_DIR"].startswith("/data/")
    for name in ("RUN__OUTPUT_DIR", "DISTRIBUTED__CACHE_DIR"):
        assert env[f"SPEEDTRONIC_{name}"].startswith("/data/runs/{node_id}"), name


@pytest.mark.parametrize(("service", "node"), [("master", "master"), ("worker", "worker-1")])
def test_every_output_follows_the_node_output_dir(service, node, tmp_path):
    """The shipped config's relative paths (events, checkpoints, DiLoCo state) land under the
    service's /data/runs/<node>: the output dir is the one setting that places a run."""
    env = compose_env(load_compose()["services"][service])
    assert "SPEEDTRONIC_LOGGING__JSON_FILE" not in env
    env = {key: value.replace("{node_id}", node) for key, value in env.items()}
    config_file = REPO / "configs" / env["SPEEDTRONIC_CONFIG"].removeprefix("/config/")
    config = resolve_config(config_file, environ=env, secrets_dir=tmp_path / "none").config
    root = Path("/data/runs") / node
    assert config.events_path == root / "events.jsonl"
    assert root in config.checkpoint_dir.parents and root in config.state_dir.parents


def test_services_are_hardened_like_the_kubernetes_pods():
    model = load_compose()
    for name in ("master", "worker", "prometheus"):
        service = model["services"][name]
        assert service["read_only"] is True, name
        assert service["cap_drop"] == ["ALL"] and "cap_add" not in service, name
        assert "no-new-privileges:true" in service["security_opt"], name
        limits = service["deploy"]["resources"]["limits"]
        assert limits["cpus"] and limits["memory"], name
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond localhost"
    for name in ("master", "worker"):
        service = model["services"][name]
        assert service["tmpfs"] == ["/tmp:size=1g,mode=1777"]
        assert service["restart"] == "on-failure"
    opened = load_compose(environ={"SPEEDTRONIC_BIND_ADDRESS": "0.0.0.0"})
    assert opened["services"]["master"]["ports"] == ["0.0.0.0:8000:8000"]
    anywhere = load_compose(environ={"SPEEDTRONIC_MASTER_PORT": ""})
    assert anywhere["services"]["master"]["ports"] == ["127.0.0.1::8000"]


def test_hub_override_reads_the_token_from_a_secret_file_only():
    model = load_compose("compose.yaml", "compose.hub.yaml", environ=HUB_ENV)
    assert model["secrets"]["hf_token"]["file"] == "./secrets/hf_token"
    # One short-lived root container copies the secret for uid 10001, with two capabilities.
    copier = model["services"]["hub-token"]
    assert copier["secrets"] == ["hf_token"] and copier["user"] == "0:0"
    assert copier["network_mode"] == "none" and copier["read_only"] is True
    assert copier["cap_drop"] == ["ALL"] and set(copier["cap_add"]) == {"CHOWN", "DAC_READ_SEARCH"}
    script = " ".join(copier["entrypoint"])
    assert "umask 0277" in script and "chown 10001:10001" in script
    for name in ("master", "worker"):
        service = model["services"][name]
        assert "secrets" not in service and service.get("user") is None
        mount = next(v for v in service["volumes"] if v["target"] == "/run/secrets")
        assert mount["source"] == "speedtronic-secrets" and mount["read_only"] is True
        assert service["depends_on"]["hub-token"] == {"condition": "service_completed_successfully"}
        env = compose_env(service)
        assert env["SPEEDTRONIC_DISTRIBUTED__REPO_ID"] == "owner/run"
        assert not {"HF_TOKEN", "SPEEDTRONIC_DISTRIBUTED__TOKEN"} & set(env)
    with pytest.raises(ValueError, match="SPEEDTRONIC_HUB_REPO"):
        load_compose("compose.yaml", "compose.hub.yaml", environ={})
    moved = load_compose(
        "compose.yaml", "compose.hub.yaml", environ={**HUB_ENV, "SPEEDTRONIC_HF_TOKEN_FILE": "/k/t"}
    )
    assert moved["secrets"]["hf_token"]["file"] == "/k/t"
    assert (REPO / "secrets/.gitignore").read_text().splitlines()[1] == "*"


@pytest.mark.parametrize(
    "files",
    [("compose.yaml",), ("compose.yaml", "compose.gpu.yaml"), ("compose.yaml", "compose.hub.yaml")],
)
def test_the_real_compose_accepts_the_files(files, tmp_path):
    """`docker compose config` (the Compose v2 CLI plugin, no engine needed) parses and
    validates the files with the current Compose Specification."""
    docker = shutil.which("docker")
    probe = (
        subprocess.run(
            [docker or "docker", "compose", "version"], capture_output=True, text=True, check=False
        )
        if docker
        else None
    )
    if probe is None or probe.returncode != 0:
        pytest.skip("no `docker compose` plugin (.ci/container-engine installs one)")
    token = tmp_path / "hf_token"
    token.write_text("x")
    argv = [docker, "compose", "--project-directory", str(REPO)]
    for name in files:
        argv += ["-f", str(REPO / name)]
    env = {**os.environ, **HUB_ENV, "SPEEDTRONIC_HF_TOKEN_FILE": str(token)}
    result = subprocess.run(
        [*argv, "config", "--quiet"], capture_output=True, text=True, env=env, timeout=60
    )
    assert result.returncode == 0, result.stderr


def test_gpu_override_reserves_nvidia_gpus():
    model = load_compose("compose.yaml", "compose.gpu.yaml")
    for name in ("master", "worker"):
        service = model["services"][name]
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
        assert compose_env(service)["SPEEDTRONIC_RUN__DEVICE"] == "cuda"
    # a worker trains on all its GPUs, one rank per GPU (issue 13); the master on one
    master, worker = model["services"]["master"], model["services"]["worker"]
    assert compose_env(worker)["SPEEDTRONIC_RUN__NPROC_PER_NODE"] == "auto"
    assert "SPEEDTRONIC_RUN__NPROC_PER_NODE" not in compose_env(master)
    assert worker["deploy"]["resources"]["reservations"]["devices"][0]["count"] == "all"
    assert master["deploy"]["resources"]["reservations"]["devices"][0]["count"] == 1
    assert worker["shm_size"]  # NCCL's shared memory between the ranks


def test_monitoring_profile_scrapes_master_and_workers():
    model = load_compose()
    prometheus = model["services"]["prometheus"]
    assert prometheus["profiles"] == ["monitoring"]
    assert "profiles" not in model["services"]["master"]
    mount = next(v for v in prometheus["volumes"] if v["target"].endswith("prometheus.yml"))
    path = REPO / mount["source"]
    scrape = yaml.safe_load(path.read_text())
    jobs = {job["job_name"]: job for job in scrape["scrape_configs"]}
    targets = [
        t for job in jobs.values() for c in job.get("static_configs", []) for t in c["targets"]
    ]
    assert "master:8000" in targets
    dns = [c for job in jobs.values() for c in job.get("dns_sd_configs", [])]
    assert dns and dns[0]["names"] == ["worker"] and dns[0]["port"] == 8000
    promtool = shutil.which("promtool")
    if promtool:
        result = subprocess.run(
            [promtool, "check", "config", str(path)], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stdout + result.stderr
