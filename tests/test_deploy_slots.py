"""Worker slots (speedtronic.slots) and the entrypoint's identity resolution: a worker
without a node id claims a free or dead slot and finds that slot's checkpoints; a live slot is
never taken over. Holders are real processes, killed for real."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import asdict
from pathlib import Path

import pytest
from test_deploy_support import REPO

from speedtronic import entrypoint
from speedtronic.config import ConfigError, resolve_config
from speedtronic.slots import Lease, SlotClaim, claim_slot

HOLDER = textwrap.dedent(
    """
    import sys, time
    from speedtronic.slots import claim_slot
    claim = claim_slot(sys.argv[1], lease_seconds=float(sys.argv[2]))
    print(claim.node_id, flush=True)
    if sys.argv[3] == "release":
        claim.release()
    else:
        time.sleep(600)
    """
)


def holder(directory: Path, *, lease: float = 30.0, release: bool = False):
    """A process that claims a slot and holds it (or releases it and exits); (proc, slot)."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            HOLDER,
            str(directory),
            str(lease),
            "release" if release else "hold",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline().strip()
    assert line.startswith("worker-"), line
    return proc, line


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


def test_slots_are_numbered_and_a_live_slot_is_never_taken(tmp_path):
    first, slot = holder(tmp_path)
    try:
        assert slot == "worker-1"
        mine = claim_slot(tmp_path)
        other = claim_slot(tmp_path)  # a second open file in this process: its own lock
        try:
            assert (mine.node_id, other.node_id) == ("worker-2", "worker-3")
        finally:
            other.release()
            mine.release()
    finally:
        kill(first)


def test_a_released_slot_is_reused(tmp_path):
    proc, slot = holder(tmp_path, release=True)
    assert proc.wait(timeout=30) == 0 and slot == "worker-1"
    assert Lease.read(tmp_path / "worker-1.json").released
    with claim_slot(tmp_path) as claim:
        assert claim.node_id == "worker-1"
        assert not Lease.read(tmp_path / "worker-1.json").released


def test_a_killed_holder_on_this_host_is_taken_over_at_once(tmp_path):
    proc, slot = holder(tmp_path)
    kill(proc)
    lease = Lease.read(tmp_path / f"{slot}.json")
    assert not lease.released and time.time() - lease.renewed_at < lease.lease_seconds
    started = time.monotonic()
    with claim_slot(tmp_path) as claim:
        assert claim.node_id == slot
        assert time.monotonic() - started < 5
        assert claim.lease.instance != lease.instance


def test_concurrent_claims_get_distinct_slots(tmp_path):
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(tmp_path), "30", "hold"],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    try:
        slots = sorted(p.stdout.readline().strip() for p in procs)
        assert slots == ["worker-1", "worker-2", "worker-3", "worker-4"]
    finally:
        for proc in procs:
            kill(proc)


def _foreign_lease(directory: Path, slot: str, renewed_at: float) -> None:
    lease = Lease(
        slot=slot,
        instance="abc",
        hostname="node-b",
        boot_id="another-kernel",
        pid=12,
        renewed_at=renewed_at,
        lease_seconds=30.0,
    )
    (directory / f"{slot}.json").write_text(json.dumps(asdict(lease)))


class FakeTime:
    def __init__(self) -> None:
        self.now = 1_000_000.0
        self.on_sleep = None

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        if self.on_sleep:
            self.on_sleep(self)

    def claim(self, directory: Path) -> SlotClaim:
        """`claim_slot` in ``directory`` (30 s leases) on this clock, as kernel ``k``."""
        return claim_slot(
            directory,
            lease_seconds=30.0,
            clock=self.clock,
            monotonic=self.clock,
            sleep=self.sleep,
            kernel="k",
        )


def test_a_fresh_lease_from_another_host_is_waited_for_then_resumed(tmp_path):
    """A worker rescheduled to another host finds its old slot again once the lease expires,
    instead of starting over in a new slot."""
    fake = FakeTime()
    _foreign_lease(tmp_path, "worker-1", fake.now - 1)
    claim = fake.claim(tmp_path)
    try:
        assert claim.node_id == "worker-1"
        assert fake.now - 1_000_000.0 > 29  # waited for the lease to expire
    finally:
        claim.release()


def test_a_lease_renewed_while_waiting_belongs_to_a_live_worker(tmp_path):
    fake = FakeTime()
    _foreign_lease(tmp_path, "worker-1", fake.now)
    fake.on_sleep = lambda t: _foreign_lease(tmp_path, "worker-1", t.now)  # keeps renewing
    claim = fake.claim(tmp_path)
    try:
        assert claim.node_id == "worker-2"
        assert Lease.read(tmp_path / "worker-1.json").hostname == "node-b"
    finally:
        claim.release()


def test_the_lease_is_renewed_while_running(tmp_path):
    with claim_slot(tmp_path, lease_seconds=0.3) as claim:
        first = claim.lease.renewed_at
        deadline = time.monotonic() + 10
        while Lease.read(claim.path).renewed_at == first and time.monotonic() < deadline:
            time.sleep(0.05)
        assert Lease.read(claim.path).renewed_at > first


# -- entrypoint --------------------------------------------------------------------------------
def worker_config(tmp_path, **env):
    environ = {
        "SPEEDTRONIC_DISTRIBUTED__ENABLED": "true",
        "SPEEDTRONIC_DISTRIBUTED__ROLE": "worker",
        "SPEEDTRONIC_DISTRIBUTED__REPO_ID": f"file://{tmp_path}/exchange",
        "SPEEDTRONIC_DISTRIBUTED__SLOTS_DIR": str(tmp_path / "slots"),
        "SPEEDTRONIC_RUN__OUTPUT_DIR": str(tmp_path / "runs/{node_id}"),
        "SPEEDTRONIC_LOGGING__JSON_FILE": str(tmp_path / "runs/{node_id}/events.jsonl"),
        "SPEEDTRONIC_DISTRIBUTED__CACHE_DIR": str(tmp_path / "runs/{node_id}/hub-cache"),
        **env,
    }
    return resolve_config(
        str(REPO / "configs/diloco.yaml"), environ=environ, secrets_dir=str(tmp_path / "none")
    )


def test_a_worker_without_a_node_id_takes_a_slot_and_its_paths(tmp_path):
    resolved = worker_config(tmp_path)
    sources = dict(resolved.sources)
    claim = entrypoint._claim_identity(resolved.config, sources)
    try:
        config = resolved.config
        assert config.distributed.node_id == claim.node_id == "worker-1"
        assert config.run.output_dir == str(tmp_path / "runs/worker-1")
        assert config.logging.json_file == str(tmp_path / "runs/worker-1/events.jsonl")
        assert config.distributed.cache_dir == str(tmp_path / "runs/worker-1/hub-cache")
        assert sources["distributed.node_id"] == f"slot:{tmp_path / 'slots'}"
    finally:
        claim.release()


def test_an_explicit_node_id_claims_no_slot(tmp_path):
    resolved = worker_config(tmp_path, SPEEDTRONIC_NODE_ID="w7")
    assert entrypoint._claim_identity(resolved.config, {}) is None
    assert resolved.config.run.output_dir == str(tmp_path / "runs/w7")
    assert not (tmp_path / "slots").exists()


def test_node_id_placeholder_without_a_node_id_is_a_config_error(tmp_path):
    resolved = worker_config(tmp_path, SPEEDTRONIC_DISTRIBUTED__SLOTS_DIR="")
    resolved.config.distributed.slots_dir = None
    with pytest.raises(ConfigError, match=r"run\.output_dir: .*\{node_id\}"):
        entrypoint._claim_identity(resolved.config, {})


@pytest.mark.parametrize("below", ["", "sub"])
def test_an_unusable_slots_dir_is_a_config_error(tmp_path, below):
    """A file where the slots directory (or its parent) should be: exit 2 naming the field,
    whether config resolution or the claim finds it."""
    (tmp_path / "taken").write_text("a file")
    slots = tmp_path / "taken" / below if below else tmp_path / "taken"
    with pytest.raises(ConfigError, match=r"distributed\.slots_dir"):
        resolved = worker_config(tmp_path, SPEEDTRONIC_DISTRIBUTED__SLOTS_DIR=str(slots))
        entrypoint._claim_identity(resolved.config, {})
