# ruff: noqa: F811  (pytest fixtures imported from tests.hub_emulator_fixtures)
"""One contract for both transports (shared volume and the Hub through the emulator),
plus the shared retry policy and error mapping."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from hub_emulator_fixtures import TEST_TOKEN, fast_retry, hub_emulator, make_transport  # noqa: F401

from speedtronic.diloco.exchange import GLOBAL_MODEL, GLOBAL_PROCESSED, GLOBAL_STEP
from speedtronic.retry import RemoteNotFound, RetryPolicy, TransportError, classify_error

KINDS = ["directory", "hub"]


@pytest.mark.parametrize("kind", KINDS)
def test_layout_contract(kind, make_transport, hub_emulator):
    t = make_transport(kind)
    t.create_repo(private=True)
    t.create_repo(private=True)  # exists: accepted
    assert t.global_metadata() is None
    assert t.read_bytes("global/missing.json") is None
    meta = t.publish_global(
        {"w": torch.ones(3), "n": torch.tensor([7])},
        outer_step=0,
        metadata_extra={"bootstrap": "true"},
    )
    got = t.global_metadata()
    assert got.outer_step == 0 and got.sha256 == meta.sha256
    state = t.read_global(got)
    assert state["w"].tolist() == [1.0, 1.0, 1.0] and state["n"].tolist() == [7]
    path = t.upload_delta(
        {"w": torch.full((3,), 0.5)},
        node_id="n1",
        round_index=0,
        local_step=10,
        base_outer_step=0,
        dtype="bf16",
        owner={"instance": "abc", "state": "training"},
    )
    assert path == "nodes/n1/delta_0.safetensors" and t.last_upload_bytes > 0
    assert t.delta_paths() == [path]
    scan = t.scan()
    assert scan.deltas == {"n1": {0: path}} and scan.owners == {"n1"}
    delta, header = t.read_delta(path)
    assert delta["w"].tolist() == [0.5] * 3
    assert header["base_outer_step"] == "0" and header["dtype"] == "bf16"
    assert header["round"] == "0" and header["local_step"] == "10"
    assert t.read_owner("n1") == {"instance": "abc", "state": "training"}
    before = t.commits
    t.publish_global(
        {"w": torch.zeros(3), "n": torch.tensor([7])},
        outer_step=1,
        ledger={"n1": 0},
        prune=[path],
    )
    assert t.commits == before + 1  # publish + prune is one commit
    files = t.list_files()
    assert path not in files
    assert {GLOBAL_MODEL, GLOBAL_STEP, GLOBAL_PROCESSED} <= set(files)
    assert t.read_ledger() == {"n1": 0}
    assert t.global_metadata().outer_step == 1 and not t.global_metadata().final
    t.publish_global({"w": torch.zeros(3), "n": torch.tensor([7])}, outer_step=1, final=True)
    assert t.global_metadata().final
    # pruning a file that is already gone is not an error
    t.prune([path])


def test_hub_upload_is_one_commit_and_uses_regular_mode(make_transport, hub_emulator):
    t = make_transport("hub")
    t.create_repo()
    before = hub_emulator.commits
    path = t.upload_delta(
        {"w": torch.ones(4)}, node_id="a", local_step=1, base_outer_step=0, owner={"instance": "x"}
    )
    assert path == "nodes/a/delta_0.safetensors"  # the round defaults to the base outer step
    assert hub_emulator.commits == before + 1
    stats = hub_emulator.stats()["counts"]
    assert stats.get("POST preupload") == 1 and stats.get("POST commit") == 1


def test_directory_writes_are_atomic(tmp_path):
    from speedtronic.diloco.directory import DirectoryTransport, directory_root

    t = DirectoryTransport(f"file://{tmp_path}/r", fast_retry())
    t.commit({"global/step_count.json": b"{}"})
    assert (tmp_path / "r/global/step_count.json").read_bytes() == b"{}"
    assert not [p for p in (tmp_path / "r").rglob(".*")]
    for bad in ("r/relative", "s3://bucket/x", "file://host/x"):
        with pytest.raises(ValueError):
            directory_root(bad)
    with pytest.raises(ValueError, match="unsafe"):
        t._parts("nodes/../../etc")


def test_hub_wrong_token_is_refused_and_never_echoed(tmp_path, hub_emulator):
    """A token that cannot see the repository is a permanent refusal (issue 20; it was a
    not-found the node retried forever), naming the repository, never the token."""
    from speedtronic.diloco.hub import HubClient

    good = HubClient("org/run", token=TEST_TOKEN, endpoint=hub_emulator.url, retry=fast_retry())
    good.create_repo()
    bad_token = "hf_wrongTOKENvalue_123456"
    bad = HubClient("org/run", token=bad_token, endpoint=hub_emulator.url, retry=fast_retry())
    with pytest.raises(TransportError) as info:
        bad.list_files()
    assert info.value.kind == "permanent" and info.value.status == 404
    assert "org/run" in str(info.value)
    assert bad_token not in str(info.value) and TEST_TOKEN not in str(info.value)
    assert bad_token not in repr(bad)


def test_retry_policy_backoff_and_retry_after():
    sleeps: list[float] = []
    calls = {"n": 0}

    class Response:
        status_code = 429
        headers: ClassVar[dict[str, str]] = {"Retry-After": "0.7"}

    class RateLimited(Exception):
        response = Response()

    def flaky():
        calls["n"] += 1
        if calls["n"] < 3:
            raise RateLimited("slow down")
        return "ok"

    retries = []
    policy = RetryPolicy(
        0.01,
        1.0,
        5,
        sleeper=sleeps.append,
        on_retry=lambda op, attempt, err: retries.append((op, attempt)),
    )
    assert policy.run("upload x", flaky) == "ok"
    assert sleeps == [0.7, 0.7]  # Retry-After wins over the (smaller) backoff
    assert retries == [("upload x", 1), ("upload x", 2)]


def test_retry_policy_exponential_cap_and_exhaustion_scrubs_token():
    sleeps: list[float] = []
    policy = RetryPolicy(1.0, 3.0, 4, sleeper=sleeps.append, secrets=("sekrit-token",))

    def boom():
        raise ConnectionError("cannot reach https://x?token=sekrit-token")

    with pytest.raises(TransportError) as info:
        policy.run("download y", boom)
    assert sleeps == [1.0, 2.0, 3.0]
    assert "sekrit-token" not in str(info.value) and "<redacted>" in str(info.value)
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_permanent_and_not_found_are_not_retried():
    sleeps: list[float] = []
    policy = RetryPolicy(0.01, 0.1, 5, sleeper=sleeps.append)

    class Resp:
        def __init__(self, code):
            self.status_code, self.headers = code, {}

    class HTTPError(Exception):
        def __init__(self, code):
            super().__init__(f"HTTP {code}")
            self.response = Resp(code)

    with pytest.raises(TransportError) as info:
        policy.run("op", lambda: (_ for _ in ()).throw(HTTPError(401)))
    assert info.value.kind == "permanent" and info.value.status == 401
    with pytest.raises(RemoteNotFound):
        policy.run("op", lambda: (_ for _ in ()).throw(FileNotFoundError("x")))
    assert sleeps == []
    assert classify_error(HTTPError(503)).kind == "transient"
    assert classify_error(TimeoutError()).kind == "transient"
    assert classify_error(TypeError()).kind == "permanent"


def test_directory_sweeps_temp_files_of_killed_writers(tmp_path):
    import os
    import time

    from speedtronic.diloco.directory import DirectoryTransport

    t = DirectoryTransport(f"file://{tmp_path}/r", fast_retry())
    t.create_repo()
    old = tmp_path / "r/nodes/a/.delta_0.safetensors.tmp-123-456"
    fresh = tmp_path / "r/global/.latest.safetensors.tmp-789-1"
    for path in (old, fresh):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"half a file")
    hour_ago = time.time() - 7200
    os.utime(old, (hour_ago, hour_ago))
    t.create_repo()  # the master opens the exchange again
    assert not old.exists() and fresh.exists()  # a writer may still be busy with the fresh one
