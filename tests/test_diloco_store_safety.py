# ruff: noqa: F811  (pytest fixtures imported from tests.hub_emulator_fixtures)
"""What the stores refuse (issue 20): links planted in a shared-volume exchange, files past
their size bound (checked on what is read, not on a listing), globals that do not fit the model
as it will be installed, and Hub access errors; and the ``Store`` protocol both stores meet."""

from __future__ import annotations

import inspect
import os
import time

import pytest
import torch
from hub_emulator_fixtures import TEST_TOKEN, fast_retry, hub_emulator, make_transport  # noqa: F401

from speedtronic.diloco.codec import delta_to_bytes, open_delta
from speedtronic.diloco.directory import DirectoryTransport
from speedtronic.diloco.exchange import GLOBAL_MODEL, Store, Transport
from speedtronic.diloco.hub import HubClient
from speedtronic.retry import AccessRefused, RemoteNotFound, TransportError
from speedtronic.testing.hub_server import HubEmulator

W = {"w": torch.ones(4)}


def _store(tmp_path) -> DirectoryTransport:
    store = DirectoryTransport(f"file://{tmp_path}/x", fast_retry())
    store.create_repo()
    return store


def _refused_as_link(info: pytest.ExceptionInfo, path: str) -> None:
    assert info.value.kind == "permanent", info.value
    assert "symbolic link" in str(info.value) and path in str(info.value)


def _open(store, path: str, **bound) -> None:
    with store.local_copy(path, **bound):
        pass


# -- links ---------------------------------------------------------------------------------------
def test_a_linked_global_directory_is_refused_and_nothing_lands_outside(tmp_path):
    store = _store(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "x/global").symlink_to(outside)
    with pytest.raises(TransportError) as info:
        store.publish_global(W, outer_step=0)
    _refused_as_link(info, "global")
    assert list(outside.iterdir()) == []
    # reads do not follow it either, and the listing does not descend into it
    (outside / "step_count.json").write_text('{"outer_step": 9}')
    with pytest.raises(TransportError) as info:
        store.global_metadata()
    _refused_as_link(info, "global")
    assert store.list_files() == []


def test_a_linked_node_directory_is_refused_and_never_listed(tmp_path):
    store = _store(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "x/nodes").mkdir()
    (tmp_path / "x/nodes/a").symlink_to(outside)
    with pytest.raises(TransportError) as info:
        store.upload_delta(W, node_id="a", local_step=1, base_outer_step=0)
    _refused_as_link(info, "nodes/a")
    with pytest.raises(TransportError) as info:
        store.claim_owner("a", {"state": "training"})
    _refused_as_link(info, "nodes/a")
    assert list(outside.iterdir()) == []
    (outside / "delta_0.safetensors").write_bytes(delta_to_bytes(W, node_id="a", **_BASE))
    (outside / "owner.json").write_text("{}")
    scan = store.scan()
    assert scan.deltas == {} and scan.owners == set() and scan.files == {}
    with pytest.raises(TransportError) as info:
        _open(store, "nodes/a/delta_0.safetensors")
    _refused_as_link(info, "nodes/a")


_BASE = {"local_step": 1, "base_outer_step": 0}


def test_linked_files_are_not_listed_read_or_written_through(tmp_path):
    store = _store(tmp_path)
    store.publish_global(W, outer_step=0)
    secret = tmp_path / "secret.json"
    secret.write_text('{"outer_step": 5}')
    step = tmp_path / "x/global/step_count.json"
    step.unlink()
    step.symlink_to(secret)
    delta = tmp_path / "x/nodes/a/delta_0.safetensors"
    delta.parent.mkdir(parents=True)
    target = tmp_path / "elsewhere.safetensors"
    target.write_bytes(delta_to_bytes(W, node_id="a", **_BASE))
    delta.symlink_to(target)
    assert "global/step_count.json" not in store.list_files()
    assert store.scan().deltas == {}
    with pytest.raises(TransportError) as info:
        store.global_metadata()
    _refused_as_link(info, "global/step_count.json")
    with pytest.raises(TransportError) as info:
        _open(store, "nodes/a/delta_0.safetensors")
    _refused_as_link(info, "nodes/a/delta_0.safetensors")
    # a write replaces the link itself; the file it pointed at is untouched
    store.publish_global(W, outer_step=1)
    assert secret.read_text() == '{"outer_step": 5}' and not step.is_symlink()
    store.prune(["nodes/a/delta_0.safetensors"])
    assert target.exists() and not os.path.lexists(delta)


def test_a_fifo_under_a_file_name_is_refused_without_hanging(tmp_path):
    store = _store(tmp_path)
    (tmp_path / "x/global").mkdir()
    os.mkfifo(tmp_path / "x/global/step_count.json")
    started = time.monotonic()
    with pytest.raises(TransportError, match="not a regular file"):
        store.global_metadata()
    assert time.monotonic() - started < 5


# -- size bounds on the file read -----------------------------------------------------------------
@pytest.mark.parametrize("kind", ["directory", "hub"])
def test_the_global_size_bound_holds_on_the_file_read(kind, make_transport, hub_emulator):
    store = make_transport(kind)
    store.create_repo()
    store.publish_global({"w": torch.zeros(1000)}, outer_step=0)
    store.list_info = lambda: {}  # a listing that says nothing (or lies) changes nothing
    with pytest.raises(TransportError, match="more than the 1000 bytes") as info:
        store.fetch_global(max_bytes=1000)
    assert info.value.kind == "permanent" and GLOBAL_MODEL in str(info.value)
    assert store.fetch_global(max_bytes=10_000)[1]["w"].shape == (1000,)


@pytest.mark.parametrize("kind", ["directory", "hub"])
def test_local_copy_checks_its_bound_on_the_file_it_hands_out(kind, make_transport, hub_emulator):
    store = make_transport(kind)
    store.create_repo()
    path = store.upload_delta({"w": torch.ones(500)}, node_id="a", **_BASE)
    size = store.last_upload_bytes
    with pytest.raises(TransportError, match=f"{size} bytes, more than the 100") as info:
        _open(store, path, max_bytes=100)
    assert info.value.kind == "permanent"
    with store.local_copy(path, max_bytes=size) as local, open_delta(local) as reader:
        assert reader.metadata["node_id"] == "a"
    with pytest.raises(RemoteNotFound):
        _open(store, "nodes/a/delta_7.safetensors", max_bytes=size)


def test_a_directory_copy_is_pinned_to_the_file_checked(tmp_path):
    store = _store(tmp_path)
    path = store.upload_delta({"w": torch.ones(4)}, node_id="a", **_BASE)
    with store.local_copy(path, max_bytes=10_000) as local:
        # a writer renames a much larger file over it after the check
        store.commit({path: delta_to_bytes({"w": torch.ones(100_000)}, node_id="a", **_BASE)})
        with open_delta(local) as reader:
            assert reader.metadata["node_id"] == "a"
            total = {"w": torch.zeros(4)}
            reader.add_to(total)  # the 4 values checked, not the 100k now under the name
    assert total["w"].tolist() == [1.0] * 4


# -- globals validated as installed ---------------------------------------------------------------
def test_a_global_finite_in_float64_but_not_in_the_models_float32_is_refused(tmp_path):
    store = _store(tmp_path)
    store.publish_global({"w": torch.full((2,), 1e300, dtype=torch.float64)}, outer_step=3)
    like = {"w": torch.zeros(2)}
    assert store.fetch_global()[1]["w"].dtype == torch.float64  # finite as stored
    with pytest.raises(TransportError, match=r"non-finite values in w after the cast") as info:
        store.fetch_global(like=like)
    assert info.value.kind == "permanent"


def test_a_global_of_another_model_is_refused_naming_the_key(tmp_path):
    store = _store(tmp_path)
    store.publish_global({"w": torch.zeros(2), "b": torch.zeros(3)}, outer_step=1)
    with pytest.raises(TransportError, match=r"missing \['c'\]") as info:
        store.fetch_global(like={"w": torch.zeros(2), "b": torch.zeros(3), "c": torch.zeros(1)})
    assert info.value.kind == "permanent"
    with pytest.raises(TransportError, match=r"unexpected \['b'\]"):
        store.fetch_global(like={"w": torch.zeros(2)})
    with pytest.raises(TransportError, match=r"b has shape \(3,\), the model \(4,\)"):
        store.fetch_global(like={"w": torch.zeros(2), "b": torch.zeros(4)})
    assert set(store.fetch_global(like={"w": torch.zeros(2), "b": torch.ones(3)})[1]) == {"w", "b"}


# -- Hub access errors ----------------------------------------------------------------------------
READ_ONLY = "hf_readOnlyTOKEN_4711_abcdefgh"
REFUSED = "hf_refusedTOKEN_0815_abcdefgh"
BLIND = "hf_blindTOKEN_1234_abcdefghijk"


@pytest.fixture
def access_hub():
    emulator = HubEmulator(
        0, token=TEST_TOKEN, read_only_tokens=[READ_ONLY], refused_tokens=[REFUSED]
    ).start()
    try:
        yield emulator
    finally:
        emulator.stop()


def _client(hub, tmp_path, token, sleeps=None, **kw) -> HubClient:
    return HubClient(
        "org/run",
        token=token,
        endpoint=hub.url,
        cache_dir=tmp_path / "cache",
        retry=fast_retry(sleeps=sleeps),
        **kw,
    )


def _bootstrap(hub, tmp_path) -> None:
    """The master's side: the repository with a global in it."""
    master = _client(hub, tmp_path, TEST_TOKEN)
    master.create_repo()
    master.publish_global(W, outer_step=0)


def _named_and_clean(exc: TransportError, status: int, token: str | None) -> None:
    message = str(exc)
    assert isinstance(exc, AccessRefused) and exc.kind == "permanent" and exc.status == status
    assert "org/run" in message and "HF_TOKEN" in message and "hf_token" in message
    if token:
        assert token not in message and token[3:15] not in message


@pytest.mark.parametrize(
    "token, status, call",
    [
        (REFUSED, 401, "global_metadata"),  # the HEAD of the version record
        (REFUSED, 401, "list_files"),
        (REFUSED, 401, "read_bytes"),  # a forced download wraps the HEAD's 401
        (READ_ONLY, 403, "claim"),  # sees the repository, may not write
        (BLIND, 404, "global_metadata"),  # a token that cannot see the repository
        (BLIND, 404, "list_files"),
        (BLIND, 404, "read_bytes"),
        (BLIND, 404, "claim"),
    ],
)
def test_hub_access_errors_are_permanent_and_name_the_repo(
    access_hub, tmp_path, token, status, call
):
    _bootstrap(access_hub, tmp_path)
    client = _client(access_hub, tmp_path, token, sleeps := [])
    action = {
        "global_metadata": client.global_metadata,
        "list_files": client.list_files,
        "read_bytes": lambda: client.read_bytes("global/processed.json"),
        "claim": lambda: client.claim_owner("a", {"state": "training"}),
    }[call]
    with pytest.raises(TransportError) as info:
        action()
    _named_and_clean(info.value, status, token)
    assert sleeps == [] and access_hub.stats()["commits"] == 1  # never retried, nothing written


def test_a_read_only_token_reads_and_is_refused_on_write(access_hub, tmp_path):
    _bootstrap(access_hub, tmp_path)
    client = _client(access_hub, tmp_path, READ_ONLY)
    assert client.global_metadata().outer_step == 0
    with pytest.raises(AccessRefused, match="HTTP 403"):
        client.upload_delta(W, node_id="a", **_BASE)


def test_a_missing_file_stays_not_found_with_a_good_token(access_hub, tmp_path):
    client = _client(access_hub, tmp_path, TEST_TOKEN)
    client.create_repo()
    assert client.global_metadata() is None  # before the bootstrap
    assert client.read_bytes("nodes/a/owner.json") is None
    with pytest.raises(RemoteNotFound):
        _open(client, "nodes/a/delta_0.safetensors", max_bytes=100)
    with pytest.raises(RemoteNotFound):
        client.fetch_global(max_bytes=100)


def test_a_repo_not_created_yet_is_waited_for_then_refused(access_hub, tmp_path):
    client = _client(access_hub, tmp_path, TEST_TOKEN, missing_repo_wait=0.5)
    assert client.global_metadata() is None  # a worker started before its master
    time.sleep(0.6)
    with pytest.raises(AccessRefused, match="404 Repository not found for org/run"):
        client.global_metadata()
    # once the repository was seen, losing sight of it is refused at once
    seen = _client(access_hub, tmp_path, TEST_TOKEN, missing_repo_wait=60.0)
    seen.create_repo()
    assert seen.global_metadata() is None
    with access_hub.lock:
        del access_hub.repos["org/run"]
    with pytest.raises(AccessRefused):
        seen.list_files()


# -- the Store protocol ---------------------------------------------------------------------------
_ATTRS = ("kind", "repo_id", "retry", "commits", "last_upload_bytes")


@pytest.mark.parametrize("kind", ["directory", "hub"])
def test_both_stores_implement_every_member_of_the_store_protocol(
    kind, make_transport, hub_emulator
):
    store = make_transport(kind)
    assert Transport is Store and isinstance(store, Store)
    for name in _ATTRS:
        assert name in Store.__annotations__ and hasattr(store, name), name
    methods = [n for n in vars(Store) if not n.startswith("_") and callable(vars(Store)[n])]
    assert {"local_copy", "scan", "fetch_global", "list_info", "prune", "read_owner"} <= set(
        methods
    ) and {"claim_owner", "upload_delta", "publish_global", "global_metadata"} <= set(methods)
    assert {"read_ledger", "create_repo", "add_collaborator"} <= set(methods)
    for name in methods:
        wanted = inspect.signature(getattr(Store, name))
        have = inspect.signature(getattr(type(store), name))
        for param in wanted.parameters.values():
            assert param.name in have.parameters, (name, param.name)
            assert have.parameters[param.name].kind == param.kind, (name, param.name)
            assert have.parameters[param.name].default == param.default, (name, param.name)
        assert inspect.getdoc(getattr(type(store), name)), name  # its own, or the Store's
