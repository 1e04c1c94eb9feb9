# ruff: noqa: F811  (pytest fixtures imported from tests.hub_emulator_fixtures)
"""A contribution the exchange cannot hand over whole and intact (issue 31, items 1, 7 and 4).

Item 1: a stored large-file object cut short, grown or replaced (its size or hash disagrees
with the Hub's LFS pointer) is retried, then refused: counted ``corrupt``, pruned, named in
the next published record (``refused``) so its node hears of it, and the round closes with
the other nodes. Item 7: every delta file names the sha256 of its data in its header, so a
file changed in place with the same size is refused on either store. Item 4: a one-part
``repo_id`` is a configuration error, and a node whose uploads are refused for good stops
with exit 2 even when the refused upload is its last.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from hub_emulator_fixtures import TEST_TOKEN, fast_retry, hub_emulator, running_emulator  # noqa: F401
from process_support import TrainProcess, child_env, tails
from test_diloco_e2e import corpus, overrides  # noqa: F401
from test_diloco_master import bootstrap, deliver, join, make_master, published
from test_diloco_node import make_node, offer, train

from speedtronic.config import ConfigError, DistributedConfig, SpeedtronicConfig
from speedtronic.diloco.codec import DATA_DIGEST, delta_from_bytes, delta_to_bytes, open_delta
from speedtronic.diloco.directory import DirectoryTransport
from speedtronic.diloco.exchange import ExchangeError, RoundSettings
from speedtronic.diloco.hub import HubClient
from speedtronic.diloco.link import NodeClaim, NodeLink
from speedtronic.retry import AccessRefused, DamagedFile, RetryPolicy, TransportError
from speedtronic.testing.hub_server import HubEmulator, LfsConfig

ROOT = Path(__file__).resolve().parents[1]
REPO = "org/damaged"
A0 = "nodes/a/delta_0.safetensors"


@pytest.fixture
def lfs_hub():
    """An emulator on which every delta and global takes the large-file path."""
    with running_emulator(3, lfs=LfsConfig(threshold=64)) as emulator:
        yield emulator


def _hub(emulator: HubEmulator, tmp_path: Path, sleeps: list | None = None) -> HubClient:
    hub = HubClient(
        REPO,
        token=TEST_TOKEN,
        endpoint=emulator.url,
        cache_dir=tmp_path / "cache",
        retry=fast_retry(attempts=4, sleeps=sleeps),
    )
    hub.create_repo()
    return hub


def _damage_object(emulator: HubEmulator, path: str, how: str) -> None:
    """Change the stored LFS object of ``path`` behind its pointer (the pointer keeps the
    size and sha256 the file was committed with)."""
    oid = emulator.repos[REPO].lfs[path]
    data = emulator.lfs.objects[oid]
    damaged = {
        "cut": data[:-10],
        "grown": data + b"\0" * 10,
        "replaced": data[:-4] + bytes(b ^ 0xFF for b in data[-4:]),  # same size
    }[how]
    emulator.lfs.objects[oid] = damaged


@pytest.mark.parametrize("how", ["cut", "grown", "replaced"])
def test_a_damaged_stored_object_is_refused_and_the_round_closes_with_the_others(
    lfs_hub, tmp_path, how
):
    sleeps: list[float] = []
    master, hub, log = make_master(tmp_path, transport=_hub(lfs_hub, tmp_path, sleeps))
    join(hub, "a")
    join(hub, "b")
    master.poll_once()
    deliver(hub, "a", 0, [2.0, 0.0])
    deliver(hub, "b", 0, [4.0, 2.0])
    assert A0 in lfs_hub.repos[REPO].lfs  # the contribution took the large-file path
    _damage_object(lfs_hub, A0, how)
    sleeps.clear()
    assert master.poll_once() is True  # the round closes with b: no stall
    assert len(sleeps) == 3  # a's file was read 4 times (the policy's attempts) first
    event = log.of("outer_step")[-1]
    assert event["included"] == ["b/0"] and event["deltas_corrupt"] == 1
    assert event["refused"] == ["a/0"]
    assert published(hub) == [-4.0, -2.0]  # b's values alone: nothing of the damaged file
    assert A0 not in hub.list_files()  # pruned with the publish
    assert hub.global_metadata().refused == ("a/0",)  # what node a reads next
    # nothing lost beyond that file: a's next contribution counts as any other
    deliver(hub, "a", 1, [1.0, 1.0])
    deliver(hub, "b", 1, [3.0, 1.0])
    assert master.poll_once() is True
    event = log.of("outer_step")[-1]
    assert event["included"] == ["a/1", "b/1"] and event["deltas_corrupt"] == 0
    assert hub.global_metadata().refused == ()
    assert hub.read_ledger() == {"a": 1, "b": 1}


def test_a_damaged_object_is_retried_before_it_is_refused(lfs_hub, tmp_path):
    """The read recovers when the object does (a damaged read is not refused at once)."""
    hub = _hub(lfs_hub, tmp_path)
    hub.commit({"blob.bin": b"x" * 256})
    oid = lfs_hub.repos[REPO].lfs["blob.bin"]
    good = lfs_hub.lfs.objects[oid]
    lfs_hub.lfs.objects[oid] = good[:100]
    healed: list[float] = []

    def sleeper(seconds: float) -> None:
        healed.append(seconds)
        lfs_hub.lfs.objects[oid] = good  # repaired before the second attempt

    hub.retry.sleeper = sleeper
    with hub.local_copy("blob.bin", max_bytes=1024) as local:
        assert local.read_bytes() == good
    assert len(healed) == 1
    lfs_hub.lfs.objects[oid] = good[:100]
    hub.retry.sleeper = lambda seconds: None
    with pytest.raises(DamagedFile) as refused, hub.local_copy("blob.bin", max_bytes=1024):
        pass
    assert refused.value.kind == "permanent" and "after 4 attempts" in str(refused.value)


def test_a_damaged_error_is_retried_then_permanent():
    calls: list[int] = []

    def read() -> bytes:
        calls.append(1)
        raise DamagedFile("x.safetensors read 3 bytes; the Hub's record of it says 9")

    policy = RetryPolicy(initial=0.0, maximum=0.0, attempts=5, sleeper=lambda s: None)
    with pytest.raises(DamagedFile, match="after 5 attempts") as refused:
        policy.run("download x", read)
    assert len(calls) == 5 and refused.value.kind == "permanent"


# -- item 7: the digest of every contribution -------------------------------------------
def _flip_a_value(data: bytes) -> bytes:
    """``data`` with its last value changed in place: same size, same header."""
    return data[:-4] + torch.tensor([0.5]).numpy().tobytes()


@pytest.mark.parametrize("store", ["directory", "hub"])
def test_a_delta_changed_in_place_with_the_same_size_is_refused(tmp_path, store, hub_emulator):
    if store == "directory":
        transport = DirectoryTransport(f"file://{tmp_path}/repo", fast_retry())
        transport.create_repo()
    else:  # a repository whose .gitattributes tracks no *.safetensors: a small delta is kept
        transport = HubClient(  # in git by the Hub, no LFS pointer to check it against
            "org/run", token=TEST_TOKEN, endpoint=hub_emulator.url,
            cache_dir=tmp_path / "cache", retry=fast_retry(),
        )  # fmt: skip
        transport.create_repo()
        transport.commit({".gitattributes": b"*.bin filter=lfs diff=lfs merge=lfs -text\n"})
    master, t, log = make_master(tmp_path, transport=transport)
    bootstrap(master, t, "a", "b")
    deliver(t, "a", 0, [0.0, 0.001])
    deliver(t, "b", 0, [4.0, 2.0])
    if store == "directory":
        path = Path(f"{tmp_path}/repo") / A0
        tampered = _flip_a_value(path.read_bytes())
        assert len(tampered) == path.stat().st_size
        path.write_bytes(tampered)
    else:
        with hub_emulator.lock:
            files = hub_emulator.repos["org/run"].files
            files[A0] = _flip_a_value(files[A0])
    assert master.poll_once() is True
    event = log.of("outer_step")[-1]
    assert event["included"] == ["b/0"] and event["deltas_corrupt"] == 1
    assert event["refused"] == ["a/0"]
    assert published(t) == [-4.0, -2.0]  # 0.5 was never applied


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16", "int8", "int4"])
def test_every_wire_format_names_the_digest_of_its_data(tmp_path, dtype):
    delta = {"w": torch.linspace(-1, 1, 300), "b": torch.ones(7)}
    data = delta_to_bytes(delta, node_id="a", local_step=1, base_outer_step=0, dtype=dtype)
    _, meta = delta_from_bytes(data)
    start = 8 + int.from_bytes(data[:8], "little")
    assert meta[DATA_DIGEST] == hashlib.sha256(data[start:]).hexdigest()
    bad = bytearray(data)
    bad[-4] ^= 0x01  # the lowest mantissa bit of a value or of a block's scale
    with pytest.raises(ValueError, match="do not match the digest in its header"):
        delta_from_bytes(bytes(bad))
    path = tmp_path / "d.safetensors"
    path.write_bytes(bytes(bad))
    reference = {k: torch.zeros_like(v) for k, v in delta.items()}
    with pytest.raises(ValueError, match="do not match the digest"), open_delta(path) as reader:
        reader.check(reference)
    path.write_bytes(data)
    with open_delta(path) as reader:
        reader.check(reference)


# -- the node hears of it ----------------------------------------------------------------
def test_the_node_hears_once_that_its_contribution_was_refused(tmp_path, caplog):
    store = DirectoryTransport(f"file://{tmp_path}/repo", fast_retry())
    store.create_repo()
    like = {"w": torch.zeros(2)}
    events: list[tuple[str, dict]] = []
    link = NodeLink(
        store,
        RoundSettings.of(
            DistributedConfig(enabled=True, repo_id=f"file://{tmp_path}/repo", role="worker")
        ),
        claim=NodeClaim("a", "worker", tmp_path / "state"),
        max_bytes=1 << 20,
        like=like,
        interrupted=threading.Event(),
        emit=lambda event, **fields: events.append((event, fields)),
    )
    store.publish_global(like, outer_step=3, refused=["b/2", "a/2"])
    assert link.fetch((-1, "")) is not None
    assert events == [("delta_refused", {"round": 2, "outer_step": 3})]
    assert any("refused this node's contribution to round 2" in r.getMessage()
               for r in caplog.records if r.levelname == "ERROR")  # fmt: skip
    store.publish_global(like, outer_step=4, refused=["a/2"])  # said again: heard once
    link.fetch((3, ""))
    assert len(events) == 1


# -- item 4: what no retry fixes ---------------------------------------------------------
@pytest.mark.parametrize("repo_id", ["single", "owner/na me", "a/b/c", "org/x.git", "-a/b"])
def test_a_hub_repo_id_must_be_owner_slash_name(repo_id):
    with pytest.raises(ConfigError, match=r"distributed\.repo_id must be 'owner/name'"):
        SpeedtronicConfig.from_dict({"distributed": {"enabled": True, "repo_id": repo_id}})
    for good in ("owner/name", "your-org/speedtronic-run", "a_b/c.d-e"):
        SpeedtronicConfig.from_dict({"distributed": {"enabled": True, "repo_id": good}})


def test_validate_refuses_a_one_part_repo_id_with_exit_2_and_one_line(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "speedtronic", "validate", "--config",
         str(ROOT / "configs/hub.yaml"), "--set", "distributed.repo_id=single"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and lines[0].startswith("error: distributed.repo_id must be")


def test_a_404_that_names_nothing_is_the_repository_missing(tmp_path, hub_emulator):
    """A server that answers 404 to every call of a repository id (no such route: not a Hub
    repository) refuses the node once ``missing_repo_wait`` passed, as a missing one does."""
    hub = HubClient(
        "single", token=TEST_TOKEN, endpoint=hub_emulator.url, cache_dir=tmp_path,
        retry=fast_retry(), missing_repo_wait=0.0,
    )  # fmt: skip
    with pytest.raises(AccessRefused, match="404"):
        hub.upload_delta({"w": torch.ones(2)}, node_id="a", local_step=1, base_outer_step=0)
    # a file missing from a repository that answered stays a missing file
    ok = HubClient(
        "org/run", token=TEST_TOKEN, endpoint=hub_emulator.url, cache_dir=tmp_path,
        retry=fast_retry(),
    )  # fmt: skip
    ok.create_repo()
    assert ok.read_bytes("nodes/a/owner.json") is None


def test_a_final_upload_refused_for_good_ends_the_node_with_a_config_error():
    """Before, finish() logged the failed final upload and the process exited 0."""
    node, _, model = make_node(inner=4)
    offer(node, 0, 0.0)
    node.merge_waiting()

    def refused(job):
        raise TransportError("commit failed: HTTP 403", kind="permanent", status=403)

    node._send = refused  # what the node's upload calls
    train(model, 1.0)
    node.after_optimizer_step()
    with pytest.raises(ExchangeError, match=r"distributed\.repo_id: the exchange refused"):
        node.finish()
    assert node.progress.carry is not None  # kept: nothing of the contribution is lost


# -- end to end: three processes through the emulator's large-file path --------------------
@pytest.mark.slow
def test_a_cut_lfs_contribution_does_not_stall_a_hub_run(tmp_path, corpus):
    """Issue 31's reproduction: every file over the LFS threshold, w1's round-2 delta object
    cut by 1,000 bytes in storage as it lands. Before: every master poll failed, no round
    closed after round 2 and the master exited 1 (RoundsStalledError). Now the file is
    refused and pruned, every round closes, w1 hears of it, every process exits 0, and
    nothing else is lost."""
    emulator = HubEmulator(0, token=TEST_TOKEN, lfs=LfsConfig(threshold=1024)).start()
    victim = "nodes/w1/delta_2.safetensors"
    cut: list[str] = []

    def damage(repo_id: str, files: dict) -> None:  # under the emulator's lock, as it lands
        oid = emulator.repos[repo_id].lfs.get(victim)
        if victim in files and oid is not None and not cut:
            emulator.lfs.objects[oid] = emulator.lfs.objects[oid][:-1000]
            cut.append(oid)

    emulator.on_commit = damage
    try:
        env = child_env(HF_TOKEN=TEST_TOKEN, HF_ENDPOINT=emulator.url, HF_HUB_DISABLE_TELEMETRY="1")
        steps, inner = 30, 5
        sets = [
            *overrides(corpus, steps, inner),
            "distributed.min_nodes=3",
            "distributed.round_timeout=20",
        ]
        nodes = [
            TrainProcess(tmp_path, name, role, "org/damaged-e2e", sets, env).start()
            for name, role in (("m", "master"), ("w1", "worker"), ("w2", "worker"))
        ]
        for node in nodes:
            assert node.wait(300, *nodes) == 0, tails(*nodes)
    finally:
        emulator.stop()
    assert cut, "the victim never took the large-file path"
    master = nodes[0]
    rounds = master.events("outer_step")
    assert [row["outer_step"] for row in rounds] == list(range(1, steps // inner + 1))
    assert [r for row in rounds for r in row["refused"]] == ["w1/2"]
    assert sum(row["deltas_corrupt"] for row in rounds) == 1
    included = {tuple(i.split("/")) for row in rounds for i in row["included"]}
    uploaded = {
        (node.name, str(row["round"])) for node in nodes for row in node.events("delta_uploaded")
    }
    assert uploaded - included == {("w1", "2")}  # nothing lost beyond the damaged file
    assert [row["round"] for row in nodes[1].events("delta_refused")] == [2]
    assert not nodes[2].events("delta_refused") and not master.events("delta_refused")
    files = emulator.files("org/damaged-e2e")
    assert victim not in files
    assert json.loads(files["global/step_count.json"])["final"] is True
