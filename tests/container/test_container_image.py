"""The image for real: it builds, caches its dependency layers apart from the source, runs its
default job, serves /healthz /readyz /metrics, stops on `docker stop` with a final checkpoint,
and needs nothing writable but /data and /tmp."""

from __future__ import annotations

import json
import shutil
import time
import uuid

import pytest
from container_support import LABEL, REPO, build_argv, checkpoint_steps, docker, report
from test_rehearsal_support import http_get

pytestmark = pytest.mark.slow

HARDENED = [
    "--read-only",
    "--tmpfs", "/tmp:size=1g,mode=1777",
    "--cap-drop", "ALL",
    "--security-opt", "no-new-privileges:true",
]  # fmt: skip


def wait_for(predicate, timeout: float, what: str, container: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        state = json.loads(docker("inspect", container).stdout)[0]["State"]
        if state["Status"] == "exited":
            logs = docker("logs", container, check=False)
            raise AssertionError(
                f"exited {state['ExitCode']} before {what}:\n{logs.stdout[-4000:]}"
            )
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def test_image_builds_for_uid_10001_with_the_entrypoint(image):
    config = json.loads(docker("image", "inspect", image).stdout)[0]["Config"]
    assert config["User"] == "10001:10001"
    assert config["Entrypoint"] == ["speedtronic", "run"]
    assert config["Healthcheck"]["Test"][0] == "CMD"
    assert not [e for e in config["Env"] if "TOKEN" in e.split("=")[0]]


def test_a_source_edit_rebuilds_only_the_package_layers(image, tmp_path):
    """Dependency layers are cached apart from the source: after a one-line change in the
    package every layer up to the package install is reused and the new ones are small."""
    context = tmp_path / "context"
    context.mkdir()
    for name in ("Dockerfile", ".dockerignore", "pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, context / name)
    for tree in ("speedtronic", "configs"):
        shutil.copytree(REPO / tree, context / tree, ignore=shutil.ignore_patterns("__pycache__"))
    init = context / "speedtronic" / "__init__.py"
    init.write_text(init.read_text() + f"\n# rebuild probe {uuid.uuid4().hex}\n")
    tag = f"speedtronic:ci-edit-{uuid.uuid4().hex[:6]}"
    argv = build_argv(tag)
    started = time.monotonic()
    try:
        docker(*argv, str(context), timeout=900, env={"DOCKER_BUILDKIT": "0"})
        seconds = time.monotonic() - started
        old_steps = {step_id for step_id, _, _ in _history(image) if step_id != "<missing>"}
        new_steps = [(by, size) for step_id, size, by in _history(tag) if step_id not in old_steps]
        new_bytes = sum(size for _, size in new_steps)
        report("rebuild_after_source_edit", {"seconds": round(seconds, 1), "new_bytes": new_bytes})
        assert any("/tmp/speedtronic-src/speedtronic" in by for by, _ in new_steps)
        assert not any("torch==" in by or "requirements.txt" in by for by, _ in new_steps)
        assert new_bytes < 10 * 1024 * 1024, new_steps
    finally:
        docker("image", "rm", "--force", tag, check=False)


def _history(tag: str) -> list[tuple[str, int, str]]:
    """``(step image id, size in bytes, created by)`` per build step of ``tag``."""
    rows = docker(
        "history", "--no-trunc", "--human=false", "--format", "{{json .}}", tag
    ).stdout.splitlines()
    out = []
    for row in rows:
        record = json.loads(row)
        out.append((record["ID"], int(record["Size"]), record["CreatedBy"]))
    return out


def test_default_docker_run_exits_0(image):
    """`docker run IMAGE` with nothing else: the image's default config trains and exits 0."""
    result = docker("run", "--rm", "--label", LABEL, image, timeout=900, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "run finished" in result.stdout


def test_running_container_serves_probes_and_stops_with_a_final_checkpoint(image):
    """A long job under the compose/k8s hardening (read-only root filesystem, no capabilities):
    /readyz, /healthz and /metrics answer on the published port; `docker stop` (SIGTERM) ends
    it with exit code 0 after a final checkpoint on the volume."""
    from prometheus_client.parser import text_string_to_metric_families

    name = f"sttest-run-{uuid.uuid4().hex[:8]}"
    volume = f"{name}-data"
    docker("volume", "create", "--label", LABEL, volume)
    try:
        docker(
            "run", "--detach", "--name", name, "--label", LABEL, *HARDENED,
            "--publish", "127.0.0.1::8000", "--volume", f"{volume}:/data",
            "--env", "SPEEDTRONIC_RUN__MAX_STEPS=1000000",
            image,
        )  # fmt: skip
        port = docker("port", name, "8000/tcp").stdout.split(":")[-1].strip()
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: http_get(base + "/readyz")[0] == 200, 300, "/readyz", name)
        assert http_get(base + "/healthz")[0] == 200

        def steps() -> float:
            status, body = http_get(base + "/metrics")
            if status != 200:
                return 0.0
            for family in text_string_to_metric_families(body):
                for sample in family.samples:
                    if sample.name == "speedtronic_train_steps_total":
                        return sample.value
            return 0.0

        wait_for(lambda: steps() >= 3, 300, "three training steps in /metrics", name)
        # Nothing but /data and /tmp is writable.
        probe = docker(
            "exec", name, "sh", "-c", "touch /opt/probe || touch /home/probe", check=False
        )
        assert probe.returncode != 0 and "Read-only file system" in probe.stderr
        assert (
            docker("exec", name, "touch", "/tmp/probe", "/data/probe", check=False).returncode == 0
        )

        docker("stop", "--time", "120", name, timeout=200)
        state = json.loads(docker("inspect", name).stdout)[0]["State"]
        logs = docker("logs", name).stdout
        assert state["ExitCode"] == 0, logs[-4000:]
        assert "SIGTERM received" in logs
        after_stop = logs[logs.index("SIGTERM received") :]
        assert "checkpoint_saved" in after_stop, after_stop[-3000:]
        assert checkpoint_steps(image, volume).get("smoke", 0) >= 3
    finally:
        docker("rm", "--force", name, check=False)
        docker("volume", "rm", "--force", volume, check=False)
