# ruff: noqa: F811  (pytest fixtures imported from tests.hub_emulator_fixtures)
"""The Hub emulator driven by the real huggingface_hub SDK: endpoints and every fault knob."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hub_emulator_fixtures import TEST_TOKEN, fast_retry, hub_emulator, make_transport  # noqa: F401

from speedtronic.retry import HubUnavailable, RetryPolicy


def test_sdk_endpoints_directly(hub_emulator, tmp_path):
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi

    api = HfApi(endpoint=hub_emulator.url, token=TEST_TOKEN)
    url = api.create_repo("org/sdk", private=True, exist_ok=True)
    assert url.endswith("org/sdk")
    api.create_repo("org/sdk", private=True, exist_ok=True)
    assert api.whoami()["name"] == "emulator"
    api.create_commit(
        "org/sdk",
        operations=[
            CommitOperationAdd(path_in_repo="a/b.txt", path_or_fileobj=b"hello"),
            CommitOperationAdd(path_in_repo="c.dat", path_or_fileobj=b"\x00\x01"),
        ],
        commit_message="two files",
    )  # a new repository holds .gitattributes, as on the Hub
    assert sorted(api.list_repo_files("org/sdk")) == [".gitattributes", "a/b.txt", "c.dat"]
    assert [f.path for f in api.list_repo_tree("org/sdk", path_in_repo="a")] == ["a/b.txt"]
    assert api.file_exists("org/sdk", "a/b.txt") and not api.file_exists("org/sdk", "zzz")
    assert api.repo_info("org/sdk").private is True
    local = api.hf_hub_download("org/sdk", "a/b.txt", local_dir=tmp_path / "dl", token=TEST_TOKEN)
    assert Path(local).read_bytes() == b"hello"
    api.create_commit(
        "org/sdk", operations=[CommitOperationDelete(path_in_repo="c.dat")], commit_message="delete"
    )
    assert api.list_repo_files("org/sdk") == [".gitattributes", "a/b.txt"]
    assert hub_emulator.repos["org/sdk"].private


def _store(make_transport, **policy):
    t = make_transport(
        "hub",
        retry=RetryPolicy(
            **{"initial": 0.01, "maximum": 0.05, "attempts": 4, "timeout": 10.0, **policy}
        ),
    )
    t.create_repo()
    return t


def test_injected_5xx_on_commit_are_retried_then_exhausted(make_transport, hub_emulator):
    retries = []
    t = _store(make_transport, on_retry=lambda op, n, err: retries.append(op))
    hub_emulator.set_faults(error_rate=0.5, endpoints="commit", seed=3)
    for step in range(4):
        t.upload_delta(
            {"w": torch.ones(2)}, node_id="a", round_index=step, local_step=step, base_outer_step=0
        )
    assert hub_emulator.stats()["counts"].get("fault:error", 0) > 0
    assert retries and all(op.startswith("commit") for op in retries)
    hub_emulator.set_faults(error_rate=1.0)
    with pytest.raises(HubUnavailable, match="after 4 attempts"):
        t.upload_delta({"w": torch.ones(2)}, node_id="a", local_step=99, base_outer_step=0)


def test_429_honours_retry_after(make_transport, hub_emulator):
    sleeps: list[float] = []
    t = _store(make_transport, sleeper=sleeps.append)
    hub_emulator.set_faults(rate_limit_rate=0.6, retry_after=0.25, endpoints="commit", seed=1)
    for step in range(3):
        t.upload_delta(
            {"w": torch.ones(2)}, node_id="a", round_index=step, local_step=step, base_outer_step=0
        )
    assert hub_emulator.stats()["counts"].get("fault:rate_limit", 0) > 0
    assert sleeps and min(sleeps) >= 0.25


def test_dropped_connections_are_retried(make_transport, hub_emulator):
    t = _store(make_transport)
    hub_emulator.set_faults(drop_rate=0.5, endpoints="commit", seed=11)
    for step in range(3):
        t.upload_delta(
            {"w": torch.ones(2)}, node_id="a", round_index=step, local_step=step, base_outer_step=0
        )
    assert hub_emulator.stats()["counts"].get("fault:drop", 0) > 0
    assert len(t.delta_paths()) == 3


def test_slow_responses_hit_the_request_timeout(make_transport, hub_emulator):
    t = _store(make_transport, timeout=0.3, attempts=2)
    t.upload_delta({"w": torch.ones(2)}, node_id="a", local_step=1, base_outer_step=0)
    hub_emulator.set_faults(slow_rate=1.0, slow_seconds=1.0, endpoints="commit")
    started = time.monotonic()
    with pytest.raises(HubUnavailable):
        t.upload_delta({"w": torch.ones(2)}, node_id="a", local_step=2, base_outer_step=0)
    assert time.monotonic() - started < 3.0
    hub_emulator.set_faults(slow_seconds=0.05)
    t.upload_delta({"w": torch.ones(2)}, node_id="a", local_step=3, base_outer_step=0)


def test_truncated_downloads_never_yield_partial_files(make_transport, hub_emulator):
    t = _store(make_transport, attempts=6)
    payload = {"w": torch.arange(4096, dtype=torch.float32)}
    t.publish_global(payload, outer_step=3)
    hub_emulator.set_faults(truncate_rate=0.5, endpoints="resolve", seed=2)
    for _ in range(3):
        state = t.read_global()
        assert torch.equal(state["w"], payload["w"])
    assert hub_emulator.stats()["counts"].get("fault:truncate", 0) > 0


def test_fault_draws_are_seeded():
    from speedtronic.testing.hub_server import FaultConfig, HubEmulator

    def draws():
        emu = HubEmulator(faults=FaultConfig(error_rate=0.3, drop_rate=0.2, seed=9))
        return [emu.draw_fault(False) for _ in range(50)]

    assert draws() == draws()


def test_module_cli_serves(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "speedtronic.testing.hub_server",
            "--port",
            str(port),
            "--error-rate",
            "0.0",
            "--seed",
            "1",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert f"127.0.0.1:{port}" in line
        from speedtronic.diloco.hub import HubClient

        t = HubClient("org/cli", endpoint=f"http://127.0.0.1:{port}", retry=fast_retry())
        t.create_repo()
        t.commit({"x.txt": b"1"})
        assert t.list_files() == [".gitattributes", "x.txt"]  # a new repo holds .gitattributes
    finally:
        proc.terminate()
        proc.wait(10)


def test_faults_on_head_requests_keep_the_connection_clean(make_transport, hub_emulator):
    t = _store(make_transport, attempts=8)
    t.publish_global({"w": torch.ones(8)}, outer_step=1)
    hub_emulator.set_faults(
        error_rate=0.3, rate_limit_rate=0.1, retry_after=0.0, endpoints="resolve", seed=4
    )
    for _ in range(6):
        assert t.global_metadata().outer_step == 1
    assert hub_emulator.stats()["counts"].get("fault:error", 0) > 0
