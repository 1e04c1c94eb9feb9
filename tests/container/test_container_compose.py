"""`compose.yaml` (and `compose.hub.yaml`) for real, as shipped: the only test-only file adds
build args and the build network (tests/container/container_support.write_build_override).

Protocol facts asserted here are the stable ones: the master's JSONL has ``outer_step`` events
whose ``included`` list names ``<worker node id>/...``; the processes exit 0; checkpoints lie
under each node's output directory.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from urllib.parse import urlparse

import pytest
from container_support import (
    Compose,
    checkpoint_steps,
    docker,
    docker_bridge_address,
    jsonl_events,
    read_volume,
    relay,
    report,
    write_build_override,
)

from speedtronic.testing.hub_server import HubEmulator

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

COMPOSE_IMAGE = "speedtronic:ci-compose"
RUN_TIMEOUT = 900  # seconds for configs/diloco.yaml to finish on a loaded 2-core machine


@pytest.fixture
def project(engine, tmp_path):
    """A factory of compose projects over the shipped files; each is taken down afterwards."""
    made: list[Compose] = []

    def make(*files: str, env: dict[str, str] | None = None) -> Compose:
        override = write_build_override(tmp_path / f"build-{len(made)}.json", ["master", "worker"])
        base_env = {"SPEEDTRONIC_IMAGE": COMPOSE_IMAGE, "SPEEDTRONIC_MASTER_PORT": ""}
        compose = Compose(files or ("compose.yaml",), {**base_env, **(env or {})}, override)
        made.append(compose)
        return compose

    yield make
    for compose in made:
        compose.down()


def included_nodes(image: str, compose: Compose) -> set[str]:
    """Node ids named in the ``included`` lists of the master's ``outer_step`` events."""
    events = jsonl_events(image, compose.volume, "/data/runs/master/events.jsonl", "outer_step")
    return {str(item).split("/", 1)[0] for e in events for item in e.get("included") or []}


def assert_hardened(container: dict) -> None:
    host = container["HostConfig"]
    assert host["ReadonlyRootfs"] is True, container["Name"]
    assert host["CapDrop"] == ["ALL"] and not host["CapAdd"], container["Name"]
    assert "no-new-privileges:true" in host["SecurityOpt"], container["Name"]
    assert container["Config"]["User"] == "10001:10001"
    for bindings in (host.get("PortBindings") or {}).values():
        assert all(b["HostIp"] == "127.0.0.1" for b in bindings), bindings


def slot_of(compose: Compose, container: dict) -> str:
    """The worker slot a container claimed (from its log)."""
    logs = docker("logs", container["Id"]).stdout
    match = re.search(r"worker slot (worker-\d+) claimed", logs)
    assert match, logs[-3000:]
    return match.group(1)


def test_compose_master_and_worker_complete_rounds_with_the_workers_delta(image, project):
    compose = project()
    compose("up", "--detach", "--build", "master", "worker", timeout=1800)
    finished = compose.wait_exited(["master", "worker"], RUN_TIMEOUT)
    for container in finished:
        assert container["State"]["ExitCode"] == 0, compose.logs()[-6000:]
        assert_hardened(container)
    (worker,) = compose.containers("worker")
    assert slot_of(compose, worker) == "worker-1"
    steps = checkpoint_steps(image, compose.volume)
    assert steps.get("master", 0) > 0 and steps.get("worker-1", 0) > 0, steps
    assert "worker-1" in included_nodes(image, compose), compose.logs("master")[-4000:]


def test_compose_scale_then_force_recreate_resumes_every_worker(image, project):
    """`--scale worker=3` runs three workers in slots worker-1..3 whose deltas reach the
    master's rounds; `up --force-recreate` replaces every container, and each new worker takes
    over a slot and resumes its checkpoint instead of starting at step 0; `docker compose
    stop` then ends every container with exit code 0."""
    compose = project()
    up = ["up", "--detach", "--scale", "worker=3", "master", "worker"]
    slots = {"worker-1", "worker-2", "worker-3"}
    compose(*up, "--build", timeout=1800)

    def scaled() -> dict[str, int]:
        steps = checkpoint_steps(image, compose.volume)
        done = all(steps.get(s, 0) > 0 for s in slots) and slots <= included_nodes(image, compose)
        return steps if done else {}

    before = wait_running(compose, scaled, "three workers with checkpoints, all in rounds")
    first = {c["Id"] for c in compose.containers("worker")}
    assert len(first) == 3

    compose(*up, "--no-build", "--force-recreate", timeout=900)
    workers = compose.containers("worker")
    assert len(workers) == 3 and not first & {c["Id"] for c in workers}, "not recreated"

    def resumed() -> dict[str, int]:
        found = {}
        for container in workers:
            logs = docker("logs", container["Id"]).stdout
            slot = re.search(r"worker slot (worker-\d+) claimed", logs)
            step = re.search(r"resumed from \S+ at step (\d+)", logs)
            if slot and step:
                found[slot.group(1)] = int(step.group(1))
        return found if len(found) == 3 else {}

    steps = wait_running(compose, resumed, "every recreated worker to resume")
    assert set(steps) == slots
    for slot, step in steps.items():
        assert step >= before[slot], (slot, step, before)
    compose("stop", "--timeout", "120", timeout=600)
    for container in compose.containers("master") + compose.containers("worker"):
        assert container["State"]["ExitCode"] == 0, compose.logs()[-6000:]
        assert_hardened(container)


def wait_running(compose: Compose, predicate, what: str):
    """Poll ``predicate`` while master and workers keep running (no exit, no restart by
    ``restart: on-failure``); its first truthy value."""
    deadline = time.monotonic() + RUN_TIMEOUT
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out: {what}\n{compose.logs()[-6000:]}"
        for container in compose.containers("master") + compose.containers("worker"):
            if container["State"]["Status"] == "exited" or container["RestartCount"]:
                raise AssertionError(
                    f"{container['Name']} exited or restarted while waiting for {what}:\n"
                    f"{compose.logs()[-6000:]}"
                )
        time.sleep(3)
    return value


def test_compose_hub_override_reads_a_0600_secret_and_never_logs_it(image, project, tmp_path):
    """compose.yaml + compose.hub.yaml against the Hub emulator, which demands the token that
    only the 0600 secret file carries (owned by another user, as on a developer machine)."""
    token = "hf_ctier_" + secrets.token_hex(12)
    secret = tmp_path / "hf_token"
    secret.write_text(token + "\n")
    secret.chmod(0o600)
    if os.geteuid() == 0:
        os.chown(secret, 1000, 1000)
    repo = "team/run"
    with (
        RelayedHub(token=token) as hub,
        relay(docker_bridge_address(), hub.port) as forward,
        relay(docker_bridge_address(), urlparse(hub.storage_url).port) as storage,
    ):
        hub.advertised = forward.url  # the repo URLs it returns must name the host clients use
        # files of 10 MiB and more (the global) take the large-file path: its storage URLs
        # must name an address containers reach too
        hub.lfs.hub_url, hub.lfs.storage_url = forward.url, storage.url
        compose = project(
            "compose.yaml",
            "compose.hub.yaml",
            env={
                "SPEEDTRONIC_HUB_REPO": repo,
                "SPEEDTRONIC_HF_TOKEN_FILE": str(secret),
                "HF_ENDPOINT": forward.url,
            },
        )
        compose("up", "--detach", "--build", "master", "worker", timeout=1800)
        (copier,) = compose.containers("hub-token")
        assert copier["State"]["ExitCode"] == 0, compose.logs("hub-token")
        master, worker = compose.containers("master")[0], compose.containers("worker")[0]
        mode = docker("exec", master["Id"], "stat", "-c", "%u %a", "/run/secrets/hf_token")
        assert mode.stdout.split() == ["10001", "400"]

        ready = "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/readyz')"

        def reached() -> bool:
            """The master committed with the token, and the worker pulled that global."""
            if not any(path.startswith("global/") for path in _files(hub, repo)):
                return False
            return docker("exec", worker["Id"], "python3", "-c", ready, check=False).returncode == 0

        wait_running(compose, reached, "the master's global on the Hub, pulled by the worker")
        compose("stop", "--timeout", "120", "master", "worker", timeout=400)
    for container in compose.containers("master") + compose.containers("worker"):
        assert container["State"]["ExitCode"] == 0, compose.logs()[-6000:]
        assert_hardened(container)
        assert not [e for e in container["Config"]["Env"] if token in e]
    assert token not in compose.logs(), "a container logged the token"
    leaks = read_volume(
        image,
        compose.volume,
        "import json, pathlib\n"
        f"token = {token!r}.encode()\n"
        "hits = [str(p) for p in pathlib.Path('/data').rglob('*')\n"
        "        if p.is_file() and token in p.read_bytes()]\n"
        "print(json.dumps(hits))\n",
    )
    assert leaks == [], f"the token was written to {leaks}"


class RelayedHub(HubEmulator):
    """The Hub emulator (loopback only) as containers see it through a `Relay`: the URLs it
    hands out (``create_repo``) name the relay's address, which huggingface_hub checks
    against HF_ENDPOINT."""

    advertised: str | None = None

    @property
    def url(self) -> str:
        return self.advertised or super().url


def _files(hub, repo: str) -> list[str]:
    try:
        return list(hub.files(repo))
    except KeyError:  # the master has not created the repository yet
        return []


# -- issue 40: a scale-down costs no round ------------------------------------------------
SCALE_ENV = {  # short rounds, a long round_timeout: a round that waits for a gone worker shows
    "SPEEDTRONIC_RUN__MAX_STEPS": "5000",
    "SPEEDTRONIC_DISTRIBUTED__INNER_STEPS": "10",
    "SPEEDTRONIC_DISTRIBUTED__ROUND_TIMEOUT": "60",
    "SPEEDTRONIC_DISTRIBUTED__DROP_AFTER": "2",
    "SPEEDTRONIC_CHECKPOINT__EVERY_STEPS": "50",
    "SPEEDTRONIC_EVAL__EVERY_STEPS": "0",
}


def published_step(image: str, compose: Compose) -> int:
    """The outer step of the global on the project's volume (-1: none yet)."""
    code = (
        "import json, pathlib\n"
        "p = pathlib.Path('/data/exchange/global/step_count.json')\n"
        "print(json.loads(p.read_text())['outer_step'] if p.exists() else -1)\n"
    )
    return int(read_volume(image, compose.volume, code))


def test_compose_scale_down_mid_run_costs_no_round(image, project, tmp_path):
    """`--scale worker=3`, then `--scale worker=1` mid-run (compose stops two workers with
    SIGTERM): they say they left and the next rounds close without waiting for them
    (round_timeout 60 s: a round that waited would last that long). The figures go into the
    tier's report (CONTAINER_TEST_REPORT) before the assertions."""
    override = write_build_override(tmp_path / "scale.json", ["master", "worker"])
    services = json.loads(override.read_text())["services"]
    services["master"]["environment"] = {
        **SCALE_ENV,
        "SPEEDTRONIC_DISTRIBUTED__EXPECTED_NODES": "4",
    }
    services["worker"]["environment"] = SCALE_ENV
    override.write_text(json.dumps({"services": services}))
    compose = project()
    compose.override = override
    up = ["up", "--detach", "master", "worker"]
    compose(*up, "--scale", "worker=3", "--build", timeout=1800)
    slots = {"worker-1", "worker-2", "worker-3"}
    wait_running(
        compose, lambda: slots <= included_nodes(image, compose), "three workers in rounds"
    )
    before = published_step(image, compose)
    started = time.monotonic()
    compose(*up, "--scale", "worker=1", "--no-recreate", timeout=600)  # SIGTERM to two
    stopped = time.monotonic() - started
    wait_running(compose, lambda: published_step(image, compose) >= before + 4, "four rounds after")
    rounds = jsonl_events(image, compose.volume, "/data/runs/master/events.jsonl", "outer_step")
    left = jsonl_events(image, compose.volume, "/data/runs/master/events.jsonl", "node_left")
    compose("stop", "--timeout", "120", timeout=600)
    earlier = [round(r["round_seconds"], 2) for r in rounds if r["outer_step"] <= before]
    after = [r for r in rounds if before < r["outer_step"] <= before + 4]
    figures = {
        "round_seconds_before": earlier[-3:],  # the first ones wait for the workers to start
        "round_seconds_after": [round(r["round_seconds"], 2) for r in after],
        "reasons_after": [r["reason"] for r in after],
        "scale_down_command_s": round(stopped, 1),
        "left": sorted(e["node_id"] for e in left),
    }
    report("scale_down", figures)
    print(json.dumps(figures))
    (kept,) = compose.containers("worker")
    assert len(figures["left"]) == 2 and slot_of(compose, kept) not in figures["left"], figures
    assert "timeout" not in figures["reasons_after"], figures
    assert max(figures["round_seconds_after"]) < 30, figures  # round_timeout is 60
    for container in compose.containers("worker"):
        assert container["State"]["ExitCode"] == 0, compose.logs("worker")[-6000:]
