"""What crosses the exchange per round is the least the protocol needs (issue 38, item 2).

A real master over a shared-volume exchange, nodes as their links write and read: the
master's own node hands its contribution over on the master's disk; the master copies each
contribution as soon as it is listed and folds the copies; with a quantized global the weights
file is uploaded once every ``FULL_GLOBAL_EVERY`` globals; marking a run final sends no
weights; a node waiting for the final global downloads it once.
"""

from __future__ import annotations

import threading

import pytest
import torch
from hub_emulator_fixtures import fast_retry
from test_diloco_global_update import _link, _state
from test_diloco_global_update import _round as round_of
from test_diloco_master import Log, bootstrap, deliver, join, make_master

from speedtronic.diloco import codec
from speedtronic.diloco import exchange as T
from speedtronic.diloco.codec import OuterUpdate, quantize
from speedtronic.diloco.directory import DirectoryTransport
from speedtronic.diloco.link import NodeClaim, NodeLink
from speedtronic.diloco.master import RelayStep, RoundMaster
from speedtronic.diloco.node import Contribution, GlobalInbox
from speedtronic.retry import TransportError


def _own(tmp_path) -> DirectoryTransport:
    """The store on the master's disk its own node hands contributions to."""
    return DirectoryTransport(f"file://{tmp_path}/state/own", fast_retry())


def _with_own(tmp_path, **overrides):
    """A master (node ``m`` is its own) and ``m``'s link, which hands its files to ``own``."""
    master, t, log = make_master(tmp_path, **overrides)
    own = _own(tmp_path)
    master = _again(master, t, own)
    claim = NodeClaim("m", "master", tmp_path / "m")
    like = {"w": torch.zeros(2), "n": torch.tensor(3)}
    link = NodeLink(
        t,
        master.settings,
        claim=claim,
        max_bytes=T.max_global_bytes(like),
        like=like,
        interrupted=threading.Event(),
        own=own,
    )
    link.claim_id(state="training")
    return master, t, log, link, own


def _again(master: RoundMaster, t, own) -> RoundMaster:
    """A master over the same exchange, state folder and own store (a restart)."""
    again = RoundMaster(
        t,
        {"w": torch.zeros(2), "n": torch.tensor(3)},
        settings=master.settings,
        state_dir=master.outer_files.state_dir,
        emit=master._emit,
        on_final=master.on_final,
        clock=master._clock,
        own=own,
    )
    again.finals = master.finals
    return again


def _send(link: NodeLink, t, round: int, values, *, final=False) -> int:
    run = t.global_metadata().run_id
    job = Contribution(round, round, 5 * (round + 1), {"w": torch.tensor(values)}, final, run)
    return link.send(job)


def test_the_masters_own_contribution_never_crosses_the_exchange(tmp_path):
    master, t, log, link, own = _with_own(tmp_path)
    join(t, "a")
    assert master.poll_once() is False  # global 0
    commits = t.commits
    assert _send(link, t, 0, [2.0, 0.0]) > 0
    assert t.commits == commits  # no upload, and the status record had not changed
    assert not [p for p in t.delta_paths() if p.startswith("nodes/m/")]
    assert own.delta_paths() == ["nodes/m/delta_0.safetensors"]
    assert master.poll_once() is False  # a is expected
    deliver(t, "a", 0, [4.0, 2.0])
    assert master.poll_once() is True
    assert t.read_global()["w"].tolist() == [-3.0, -1.0]  # both, equal weight
    assert t.read_ledger() == {"a": 0, "m": 0}
    assert own.delta_paths() == [] and t.delta_paths() == []  # consumed: gone from both
    assert log.of("outer_step")[-1]["included"] == ["a/0", "m/0"]


def test_the_own_contribution_is_folded_once_across_a_master_restart(tmp_path):
    master, t, _log, link, own = _with_own(tmp_path)
    join(t, "a")
    master.poll_once()
    _send(link, t, 0, [2.0, 0.0])  # the master dies before it reads it
    deliver(t, "a", 0, [4.0, 2.0])
    again = _again(master, t, own)
    assert again.poll_once() is True
    assert t.read_ledger() == {"a": 0, "m": 0}
    assert t.read_global()["w"].tolist() == [-3.0, -1.0]
    _send(link, t, 0, [2.0, 0.0])  # the node resumed from a checkpoint: sent again
    assert again.poll_once() is False
    assert own.delta_paths() == []  # a replay: pruned from this disk, counted once
    assert t.read_ledger() == {"a": 0, "m": 0}


def test_a_failed_publish_keeps_the_own_contribution_until_one_lands(tmp_path):
    master, t, _log, link, own = _with_own(tmp_path)
    master.poll_once()
    _send(link, t, 0, [2.0, 2.0])
    original = t.publish_global
    t.publish_global = lambda *a, **k: (_ for _ in ()).throw(TransportError("hub down"))
    with pytest.raises(TransportError):
        master.poll_once()
    assert own.delta_paths() == ["nodes/m/delta_0.safetensors"]  # the only copy stays
    t.publish_global = original
    master.poll_once()  # the kept round is published again
    assert t.global_metadata().outer_step == 1 and t.read_ledger() == {"m": 0}
    assert t.read_global()["w"].tolist() == [-2.0, -2.0]
    master.poll_once()
    assert own.delta_paths() == []


def test_the_done_status_of_the_masters_node_reaches_the_exchange_and_ends_the_run(tmp_path):
    master, t, _log, link, _own = _with_own(tmp_path)
    master.poll_once()
    _send(link, t, 0, [1.0, 1.0], final=True)
    record = t.read_owner("m")
    assert (record["state"], record["final_round"]) == ("done", 0)  # before the file
    assert master.poll_once() is True
    assert master.finished.is_set() and t.global_metadata().final
    assert master.finals == [(1, [-1.0, -1.0])]


def test_an_own_contribution_whose_status_record_fails_leaves_nothing_behind(tmp_path):
    master, t, _log, link, own = _with_own(tmp_path)
    master.poll_once()
    original = t.claim_owner
    t.claim_owner = lambda *a, **k: (_ for _ in ()).throw(TransportError("hub down"))
    with pytest.raises(TransportError):  # the node carries it whole into its next try
        _send(link, t, 0, [1.0, 1.0], final=True)
    assert own.delta_paths() == []  # the done status goes first: no file without it
    t.claim_owner = original
    _send(link, t, 0, [1.0, 1.0], final=True)
    assert own.delta_paths() == ["nodes/m/delta_0.safetensors"]
    assert master.poll_once() is True and master.finished.is_set()


class Downloads:
    """Counts the exchange's reads of contribution files (``local_copy``)."""

    def __init__(self, t):
        self.paths: list[str] = []
        original = t.local_copy

        def counted(path, max_bytes=None):
            self.paths.append(path)
            return original(path, max_bytes)

        t.local_copy = counted


def test_a_contribution_is_copied_in_the_poll_that_lists_it_and_folded_from_the_copy(tmp_path):
    master, t, _log = make_master(tmp_path)
    bootstrap(master, t, "a", "b")
    reads = Downloads(t)
    deliver(t, "a", 0, [2.0, 0.0])
    assert master.poll_once() is False  # b is still training: a's file is read now
    assert master.files.settled(10)  # on the fetch thread
    assert reads.paths == ["nodes/a/delta_0.safetensors"]
    assert (tmp_path / "state/fetched/nodes/a/delta_0.safetensors").is_file()
    deliver(t, "b", 0, [4.0, 2.0])
    assert master.poll_once() is True
    assert sorted(reads.paths) == ["nodes/a/delta_0.safetensors", "nodes/b/delta_0.safetensors"]
    assert t.read_global()["w"].tolist() == [-3.0, -1.0]
    assert not (tmp_path / "state/fetched").exists()  # at most the open round's files


class GatedDownloads(Downloads):
    """Downloads that wait for :attr:`gate` (a slow link), counted as they start."""

    def __init__(self, t):
        super().__init__(t)
        self.gate, counted = threading.Event(), t.local_copy

        def gated(path, max_bytes=None):
            assert self.gate.wait(10)
            return counted(path, max_bytes)

        t.local_copy = gated


def test_the_round_thread_folds_while_a_download_is_under_way_and_waits_only_for_its_file(
    tmp_path,
):
    master, t, _log = make_master(tmp_path)
    bootstrap(master, t, "a", "b")
    reads = GatedDownloads(t)
    deliver(t, "a", 0, [2.0, 0.0])
    assert master.poll_once() is False  # returns with a's download still under way
    assert not master.files.settled(0.2)
    deliver(t, "b", 0, [4.0, 2.0])
    threading.Timer(0.3, reads.gate.set).start()  # the slow link delivers a's file later
    assert master.poll_once() is True  # the fold waits for a's copy, reads b's itself
    assert sorted(reads.paths) == ["nodes/a/delta_0.safetensors", "nodes/b/delta_0.safetensors"]
    assert t.read_global()["w"].tolist() == [-3.0, -1.0]
    assert master.files.settled(10) and not (tmp_path / "state/fetched").exists()


def test_a_later_rounds_file_is_copied_while_the_open_round_waits_and_read_once(tmp_path):
    master, t, _log = make_master(tmp_path, sync="overlapped", overlap_steps=5)
    bootstrap(master, t, "a", "b")
    reads = Downloads(t)
    deliver(t, "a", 0, [2.0, 0.0])
    deliver(t, "a", 1, [2.0, 2.0])  # overlapped: a sent its next round before round 0 closed
    assert master.poll_once() is False and master.files.settled(10)
    assert reads.paths == ["nodes/a/delta_0.safetensors", "nodes/a/delta_1.safetensors"]
    deliver(t, "b", 0, [4.0, 2.0])
    assert master.poll_once() is True and master.files.settled(10)
    fetched = tmp_path / "state/fetched/nodes"
    assert [p.name for p in (fetched / "a").iterdir()] == ["delta_1.safetensors"]  # kept
    deliver(t, "b", 1, [0.0, 2.0])
    assert master.poll_once() is True and master.files.settled(10)
    assert sorted(reads.paths) == [
        *[f"nodes/{n}/delta_{r}.safetensors" for n in "ab" for r in (0, 1)]
    ]  # a's round-1 file once, ahead of its round
    assert t.read_global()["w"].tolist() == [-4.0, -3.0]
    assert not (tmp_path / "state/fetched").exists()


def test_the_fetch_thread_starts_again_for_every_file_listed_after_it_ended(tmp_path):
    """The fetch thread ends when nothing is left to copy; a file listed at any moment after
    is copied by a new one (none is left waiting for a thread that is on its way out)."""
    master, t, _log = make_master(tmp_path)
    bootstrap(master, t, "a")
    files = master.files
    for r in range(30):
        deliver(t, "a", r, [1.0, 0.0])
        files.scan()
        files.prefetch({"a": {r: f"nodes/a/delta_{r}.safetensors"}}, master.max_delta_bytes)
        assert files.settled(5), r
        assert (tmp_path / f"state/fetched/nodes/a/delta_{r}.safetensors").is_file(), r


@pytest.mark.parametrize("sync, trims", [("blocking", True), ("overlapped", False)])
def test_a_round_beside_training_leaves_the_heap_alone(tmp_path, monkeypatch, sync, trims):
    """glibc's trim takes the training thread's free pages too: not while it trains."""
    calls: list[int] = []
    monkeypatch.setattr(codec, "_malloc_trim", lambda: calls.append)
    master, t, _log = make_master(tmp_path, sync=sync)
    bootstrap(master, t, "a", "b")
    deliver(t, "a", 0, [2.0, 0.0])
    deliver(t, "b", 0, [4.0, 2.0])
    assert master.poll_once() is True
    assert t.read_global()["w"].tolist() == [-3.0, -1.0]
    assert (len(calls) >= 2) is trims and set(calls) <= {0}  # after each file, after the round


def test_a_damaged_copy_is_refused_and_a_restart_reads_the_exchange_again(tmp_path):
    master, t, log = make_master(tmp_path)
    bootstrap(master, t, "a", "b")
    deliver(t, "a", 0, [2.0, 0.0])
    deliver(t, "b", 0, [4.0, 2.0])
    fetched = tmp_path / "state/fetched/nodes"
    master.files.scan()
    master.files.prefetch({"a": {0: "nodes/a/delta_0.safetensors"}}, master.max_delta_bytes)
    assert master.files.settled(10)
    assert (fetched / "a/delta_0.safetensors").is_file()
    master = _again(master, t, None)  # a restart empties the copies: the exchange is read again
    assert not fetched.exists()
    master.files.scan()
    master.files.prefetch({"b": {0: "nodes/b/delta_0.safetensors"}}, master.max_delta_bytes)
    assert master.files.settled(10)
    copy = fetched / "b/delta_0.safetensors"
    data = bytearray(copy.read_bytes())
    data[-3] ^= 0xFF  # the copy on this disk changed after it was read
    copy.write_bytes(bytes(data))
    assert master.poll_once() is True  # refused as a damaged file is, the round goes on
    event = log.of("outer_step")[-1]
    assert event["included"] == ["a/0"] and event["deltas_corrupt"] == 1
    assert event["refused"] == ["b/0"]


# -- a quantized global: the weights file once every FULL_GLOBAL_EVERY globals ----------------
def _round(master, t, r: int) -> None:
    round_of(master, t, ["a", "b"], r)


def _quantized(tmp_path, monkeypatch, every: int, **overrides):
    monkeypatch.setattr(T, "FULL_GLOBAL_EVERY", every, raising=False)
    overrides = {"global_dtype": "int8", **overrides}
    master, t, log = make_master(tmp_path, state=_state(), **overrides)
    join(t, "a")
    join(t, "b")
    assert master.poll_once() is False  # global 0
    return master, t, log


def _same(state, master) -> bool:
    return all(torch.equal(state[k], v) for k, v in master.global_state.items())


def test_a_quantized_global_uploads_its_weights_file_once_every_n_globals(tmp_path, monkeypatch):
    master, t, _ = _quantized(tmp_path, monkeypatch, every=3)
    weights = t.root / "global/latest.safetensors"
    written = {0: weights.stat().st_ino}
    for r in range(5):
        _round(master, t, r)
        step = r + 1
        if weights.stat().st_ino != written[max(written)]:
            written[step] = weights.stat().st_ino
        assert _same(t.read_global(), master)  # a joiner's global: the file + the updates
        record = t.global_metadata()
        assert record.outer_step == step and len(record.chain) == step - max(written)
    assert sorted(written) == [0, 3]  # globals 1, 2, 4 and 5 were their update only
    updates = sorted(p.name for p in (t.root / "global").glob("update_*"))
    assert updates == [f"update_{k}.safetensors" for k in (3, 4, 5)]  # 1 and 2 pruned


def test_a_node_that_missed_rounds_applies_the_updates_it_missed(tmp_path, monkeypatch):
    master, t, _ = _quantized(tmp_path, monkeypatch, every=8)
    link = _link(tmp_path, t, master, "a")
    first = link.fetch((-1, ""))
    for r in range(3):
        _round(master, t, r)
    candidate = link.fetch((first.outer_step, first.run_id))  # global 3, from global 0
    assert candidate.source == "update" and candidate.outer_step == 3
    assert _same(candidate.state, master)
    sizes = [(t.root / T.update_path(k)).stat().st_size for k in (1, 2, 3)]
    assert candidate.nbytes == sum(sizes)  # the three updates, not the weights file


def test_a_damaged_update_keeps_a_node_on_its_global_until_the_next_weights_file(
    tmp_path, monkeypatch
):
    log = Log()
    master, t, _ = _quantized(tmp_path, monkeypatch, every=3)
    link = _link(tmp_path, t, master, "a", log)
    seen = link.fetch((-1, ""))
    _round(master, t, 0)
    path = t.root / T.update_path(1)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # the stored update is damaged: it no longer hashes to the record
    path.write_bytes(bytes(data))
    reads = Downloads(t)
    assert link.fetch((seen.outer_step, seen.run_id)) is None  # never wrong weights
    assert [e["outer_step"] for e in log.of("global_update_refused")] == [1]
    assert [e["outer_step"] for e in log.of("global_rejected")] == [1]
    _round(master, t, 1)
    count = len(reads.paths)
    assert link.fetch((seen.outer_step, seen.run_id)) is None  # the same weights file
    assert reads.paths[count:] == []  # not read again: no download at every poll
    _round(master, t, 2)  # global 3: a new weights file
    candidate = link.fetch((seen.outer_step, seen.run_id))
    assert candidate.source == "full" and candidate.outer_step == 3
    assert _same(candidate.state, master)


# -- the end of a run: the record marks it final, the final global is read once -------------
@pytest.mark.parametrize("wire", ["fp32", "int8"])
def test_marking_the_run_final_sends_no_weights(tmp_path, monkeypatch, wire):
    master, t, _ = _quantized(tmp_path, monkeypatch, every=8, global_dtype=wire)
    _round(master, t, 0)
    files = {p.name: p.stat().st_ino for p in (t.root / "global").glob("*.safetensors")}
    before = t.read_global()
    for node in ("a", "b"):  # the last step fell on a boundary: a done status only
        t.claim_owner(node, {"instance": f"{node}-1", "state": "done", "final_round": 0})
    commits = t.commits
    master.poll_once()
    assert master.finished.is_set()
    record = t.global_metadata()
    assert record.final and record.outer_step == 1 and t.commits == commits + 1
    after = {p.name: p.stat().st_ino for p in (t.root / "global").glob("*.safetensors")}
    assert after == files  # no weights, no update sent again
    assert all(torch.equal(before[k], v) for k, v in t.read_global().items())


def test_a_node_waiting_for_the_final_global_downloads_it_once(tmp_path):
    master, t, _ = make_master(tmp_path, final_average=2)
    join(t, "a")
    master.poll_once()
    link = _link(tmp_path, t, master, "a")
    like = {"w": torch.zeros(2), "n": torch.tensor(3)}
    link.like, link.max_bytes = like, T.max_global_bytes(like)
    deliver(t, "a", 0, [2.0, 2.0])
    master.poll_once()  # global 1
    inbox = GlobalInbox(link.fetch, interval=0.0, threaded=False)
    inbox.offer(link.fetch((-1, "")))
    assert inbox.take().outer_step == 1
    reads = Downloads(t)
    inbox.expect_final()  # the node is done and waits for the final global
    for _ in range(3):
        inbox.poll_due()
    assert inbox.take() is None and "global/latest.safetensors" not in reads.paths
    t.claim_owner("a", {"instance": "a-1", "state": "done", "final_round": 0})
    master.poll_once()  # every node is done: the final global, the mean of the last two
    for _ in range(3):
        inbox.poll_due()
    final = inbox.take()
    assert final.final and final.outer_step == 1 and final.state["w"].tolist() == [-1.0, -1.0]
    assert reads.paths.count("global/latest.safetensors") == 1


def test_a_group_leader_follows_a_quantized_top_level_global_by_its_updates(tmp_path, monkeypatch):
    master, t, _ = _quantized(tmp_path, monkeypatch, every=8)
    relay = RelayStep(
        t,
        node_id="g1",
        settings=master.settings,
        record=lambda **status: {"instance": "leader", **status},
        stop=threading.Event(),
    )
    meta, state = relay._fetch(t.global_metadata())  # global 0: the weights file
    assert meta.outer_step == 0 and _same(state, master)
    reads = Downloads(t)
    for r in range(2):
        _round(master, t, r)
        meta, state = relay._fetch(t.global_metadata())
        assert meta.outer_step == r + 1 and _same(state, master)
    assert reads.paths[-1] == T.update_path(2)
    assert "global/latest.safetensors" not in reads.paths  # never the weights file again


def _half_update(state: dict, key: str, base: int) -> OuterUpdate:
    """An int8 update to one tensor of ``state`` (a fragment round's) from global ``base``."""
    encoded = {key: quantize(torch.full_like(state[key], 0.5), 8, 64)}
    return OuterUpdate(encoded, "int8", 64, base, "", base + 1, "", "run")


def test_a_fragment_update_counts_as_its_part_of_the_model(tmp_path):
    """Issue 38: the weights file comes back once the updates after it cover
    FULL_GLOBAL_EVERY models, so a fragment round's update (half the values here) counts
    half: twice as many globals between weights files, and a joiner still downloads at most
    the file and FULL_GLOBAL_EVERY models' updates."""
    store = DirectoryTransport(f"file://{tmp_path}/exchange", fast_retry())
    state = {"a": torch.zeros(64), "b": torch.zeros(64)}
    store.publish_global(state, outer_step=0, run_id="run")
    weights = tmp_path / "exchange" / T.GLOBAL_MODEL
    written = []
    for step in range(1, 2 * T.FULL_GLOBAL_EVERY + 2):
        inode = weights.stat().st_ino
        update = _half_update(state, "ab"[step % 2], step - 1)
        record = store.publish_global(state, outer_step=step, run_id="run", update=update)
        if weights.stat().st_ino != inode:
            written.append(step)
            assert record.chain == ()
        else:
            assert len(record.chain) == step - max([0, *written])
    # 15 halves after global 0 cover 7.5 models; the 16th would make 8: a weights file (whole
    # updates: at global 8)
    assert written == [2 * T.FULL_GLOBAL_EVERY]
    whole = {"a": quantize(torch.ones(64), 8, 64), "b": quantize(torch.ones(64), 8, 64)}
    assert T.update_share(OuterUpdate(whole, "int8", 64, 0, ""), state) == 1.0


# -- a fresh worker built like the master downloads no first global ---------------------------
@pytest.mark.parametrize("global_dtype", ["fp32", "int8"])
def test_a_worker_built_like_the_master_takes_its_first_global_from_its_own_weights(
    tmp_path, global_dtype
):
    """Issue 38: the master's first global is the model it built from the run's seed; a fresh
    worker built alike holds it byte for byte already (the weights file's sha256, computed
    on the worker, is the record's) and downloads nothing: a copy of its own weights, source
    ``own``, 0 bytes. One built otherwise (another seed), a resumed one, and any later global
    are downloaded as before."""
    master, t, _ = make_master(tmp_path, state=_state(), global_dtype=global_dtype)
    join(t, "a")
    join(t, "b")
    assert master.poll_once() is False  # global 0
    link = _link(tmp_path, t, master, "a")  # its model: _state(), as the master's
    candidate, ended = link.first_global("", resumed=False)
    assert not ended and candidate.source == "own" and candidate.nbytes == 0
    assert _same(candidate.state, master)
    link.like["w"].add_(1.0)  # the node trains: the global it holds stays the first one
    assert _same(candidate.state, master)
    if global_dtype == "int8":  # the next global is global 0 (held) plus its update
        round_of(master, t, ["a", "b"], 0)
        following = link.fetch((candidate.outer_step, candidate.run_id))
        assert following.source == "update" and _same(following.state, master)

    other = _link(tmp_path, t, master, "b")
    other.like["w"].mul_(2.0)  # built from another seed: the first global is downloaded
    first, _ = other.first_global("", resumed=False)
    assert first.source == "full" and first.nbytes > 0 and _same(first.state, master)
    again = _link(tmp_path, t, master, "c")
    resumed, _ = again.first_global("", resumed=True)  # its weights are a checkpoint's
    assert resumed.source in ("full", "update") and _same(resumed.state, master)


@pytest.mark.parametrize("global_dtype", ["fp32", "int8"])
def test_a_worker_built_like_the_master_starts_before_global_0_is_uploaded(
    tmp_path, monkeypatch, global_dtype
):
    """Issue 38: a master starting a run announces global 0 (``global/start.json``: its run
    id and the sha256 its weights file will have) and leaves the upload to its round thread,
    which publishes its record before anything else; a fresh worker built alike takes its own
    weights as global 0 from the announcement, before the file is there, and contributes to
    round 0 of that run. One built otherwise waits for the weights file, as before."""
    master, t, _ = make_master(tmp_path, state=_state(), global_dtype=global_dtype)
    join(t, "a")
    join(t, "b")
    master.reconcile(announce=True)
    assert t.global_metadata() is None  # nothing of the weights sent yet
    announced = t.announced()
    assert announced.run_id == master.run_id and announced.outer_step == 0
    link = _link(tmp_path, t, master, "a")  # its model: _state(), as the master's
    candidate, ended = link.first_global("", resumed=False)
    assert not ended and (candidate.source, candidate.nbytes) == ("own", 0)
    assert (candidate.outer_step, candidate.run_id) == (0, master.run_id)
    assert _same(candidate.state, master)
    other = _link(tmp_path, t, master, "b")
    other.like["w"].mul_(2.0)  # built from another seed: not its global
    other._start = other.like  # as while it looks for its first global
    hashed = []
    sha = codec.safetensors_sha256
    monkeypatch.setattr(
        codec, "safetensors_sha256", lambda *a, **k: hashed.append(1) or sha(*a, **k)
    )
    assert other._announced("") is None and other._announced("") is None
    assert len(hashed) == 1  # polled again while it waits: the announcement is not hashed again
    other._start = None
    assert master.poll_once() is False  # the round thread: global 0 first
    record = t.global_metadata()
    assert (record.outer_step, record.run_id, record.sha256) == (0, master.run_id, announced.sha256)
    assert link.fetch((0, master.run_id)) is None  # the worker holds it already
    first, _ = other.first_global("", resumed=False)
    assert first.source == "full" and _same(first.state, master)
    round_of(master, t, ["a", "b"], 0)  # round 0 of the announced run closes as any other
    following = link.fetch((candidate.outer_step, candidate.run_id))
    assert following.outer_step == 1 and _same(following.state, master)
    if global_dtype == "int8":  # the update applies to the global it took from its weights
        assert following.source == "update"


# -- a final global that is the mean of the last two, made on the node -----------------------
@pytest.mark.parametrize("defect", [None, "damaged update"])
def test_a_node_holding_the_global_before_the_last_makes_the_final_mean_itself(
    tmp_path, monkeypatch, caplog, defect
):
    """Issue 38: with a quantized global and ``final_average: 2`` the final global is the
    mean of the last two; the master publishes the update that made the last one and no
    weights file (the record names the mean's digest), so a node holding the one before
    makes the mean itself (the master's float32 additions and average), checks its digest
    and downloads only the update; a node holding an older global reads the weights file and
    the chain and makes the mean too. Every node ends on the master's final global bit for
    bit. A damaged update (changed by the final's weights file going: before, the node
    downloaded that file) leaves the final global unmade on the exchange: refused once, the
    node keeps the global it holds."""
    master, t, _ = _quantized(tmp_path, monkeypatch, every=8, final_average=2)
    link = _link(tmp_path, t, master, "a")
    old = _link(tmp_path, t, master, "b")
    first = link.fetch((-1, ""))
    assert old.fetch((-1, "")).outer_step == 0  # "b" stays on global 0
    _round(master, t, 0)
    held = link.fetch((first.outer_step, first.run_id))
    assert held.source == "update" and held.outer_step == 1
    gen = torch.Generator().manual_seed(7)
    for node in ("a", "b"):  # the last contributions: the final global is the mean
        deliver(
            t,
            node,
            1,
            (torch.randn(_state()["w"].numel(), generator=gen) * 0.01).tolist(),
            final=True,
        )
    weights = (t.root / T.GLOBAL_MODEL).stat().st_ino
    assert master.poll_once() is True and master.finished.is_set()
    record = t.global_metadata()
    assert record.final and record.outer_step == 2 and record.mean_update
    assert record.mean_digest and (t.root / T.GLOBAL_MODEL).stat().st_ino == weights
    if defect:
        path = t.root / T.update_path(2)
        data = bytearray(path.read_bytes())
        data[-1] ^= 1
        path.write_bytes(bytes(data))
        final = link.fetch((held.outer_step, held.run_id), final=True)
        assert final is None and "downloading it instead" in caplog.text
        assert "refusing the published global" in caplog.text
        assert link.held.outer_step == 1  # the global it holds
        with pytest.raises(TransportError):
            t.read_global()
        return
    published = t.read_global()
    assert _same(published, master)
    reads = Downloads(t)
    final = link.fetch((held.outer_step, held.run_id), final=True)
    assert final.final and final.outer_step == 2 and _same(final.state, master)
    assert final.source == "mean" and reads.paths == [T.update_path(2)]
    assert final.nbytes == (t.root / T.update_path(2)).stat().st_size
    behind = old.fetch((0, held.run_id), final=True)  # holds global 0: file + chain, the mean
    assert behind.source == "full" and _same(behind.state, master)


def test_a_node_holding_the_last_two_globals_makes_the_final_mean_itself(tmp_path, monkeypatch):
    """Issue 38: when the last round ended on a boundary, the final global (the mean of the
    last two, ``final_average: 2``) is published after the last global as a record alone
    (the chain makes both, the record names the mean's digest; no weights file); a node
    that holds both (it keeps the one before the last) makes the mean itself and downloads
    nothing. A node that holds only the last reads the weights file and the chain."""
    master, t, _ = _quantized(tmp_path, monkeypatch, every=8, final_average=2)
    link = _link(tmp_path, t, master, "a")
    late = _link(tmp_path, t, master, "b")
    seen = link.fetch((-1, ""))
    for r in range(2):
        _round(master, t, r)
        seen = link.fetch((seen.outer_step, seen.run_id))
        assert seen.source == "update"
    assert (link.before.outer_step, link.held.outer_step) == (1, 2)
    last = late.fetch((-1, ""))  # joins at global 2: holds it, not global 1
    for node in ("a", "b"):  # the last step fell on a boundary: a done status only
        t.claim_owner(node, {"instance": f"{node}-1", "state": "done", "final_round": 1})
    weights = (t.root / T.GLOBAL_MODEL).stat().st_ino
    master.poll_once()
    record = t.global_metadata()
    assert master.finished.is_set() and record.final and record.outer_step == 2
    assert record.mean_digest and (t.root / T.GLOBAL_MODEL).stat().st_ino == weights
    assert _same(t.read_global(), master)
    reads = Downloads(t)
    final = link.fetch((seen.outer_step, seen.run_id), final=True)
    assert final.source == "mean" and final.nbytes == 0 and reads.paths == []
    assert _same(final.state, master)
    behind = late.fetch((last.outer_step, last.run_id), final=True)
    assert behind.source == "full" and _same(behind.state, master)
    assert T.GLOBAL_MODEL in reads.paths


# -- an fp32 global of streamed rounds travels as the fragment's new values -----------------
def _fragment(t, node: str, r: int, delta: dict) -> None:
    """``node``'s contribution to round ``r`` holding one fragment's tensors."""
    t.upload_delta(
        delta,
        node_id=node,
        round_index=r,
        local_step=2 * (r + 1),
        base_outer_step=r,
        owner={"instance": f"{node}-1", "state": "training"},
        metadata={"run_id": t.global_metadata().run_id, "instance": f"{node}-1"},
    )


def test_a_streamed_round_of_an_fp32_global_sends_only_its_fragments_new_values(tmp_path):
    """Issue 38 item 2: with ``fragments: 2`` and an fp32 global each round moves half the
    model, and the global is published as the new values of those tensors (exact: they
    replace the old ones); a node holding the global before takes them and holds the
    master's global bit for bit, downloading half the model a round instead of all of it."""
    gen = torch.Generator().manual_seed(7)
    state = {"a": torch.randn(256, generator=gen), "b": torch.randn(256, generator=gen)}
    state["n"] = torch.tensor(3)
    master, t, _ = make_master(
        tmp_path, state=state, fragments=2, inner_steps=4, outer_momentum=0.9, outer_lr=0.7
    )
    join(t, "a")
    join(t, "b")
    assert master.poll_once() is False  # global 0
    like = {k: v.clone() for k, v in state.items()}
    link = NodeLink(
        t,
        master.settings,
        claim=NodeClaim("b", "worker", tmp_path / "b"),
        max_bytes=T.max_global_bytes(like),
        like=like,
        interrupted=threading.Event(),
    )
    held = link.fetch((-1, ""))
    assert held.source == "full"
    file = tmp_path / "repo" / T.GLOBAL_MODEL
    weights, written = file.stat().st_size, [file.stat().st_ino]
    for r in range(5):
        key = "ab"[r % 2]
        for node in ("a", "b"):
            _fragment(t, node, r, {key: torch.randn(256, generator=gen) * 0.01})
        assert master.poll_once() is True
        held = link.fetch((held.outer_step, held.run_id))
        assert (held.outer_step, held.source) == (r + 1, "update")
        assert all(torch.equal(held.state[k], v) for k, v in master.global_state.items())
        assert held.nbytes < 0.6 * weights  # one of the two tensors and a header
        if file.stat().st_ino != written[-1]:
            written.append(file.stat().st_ino)
            assert r + 1 == 4  # half the model in fp32 counts 2 int8 models: 4 x 2 = 8
        # a node that missed rounds (or joins) reads the weights file and the updates after it
        assert all(torch.equal(t.read_global()[k], v) for k, v in master.global_state.items())
    assert len(written) == 2


@pytest.mark.parametrize("defect", ["shape", "dtype", "values"])
def test_an_fp32_update_that_does_not_make_the_global_is_refused(tmp_path, defect):
    """An fp32 update replaces tensors: one of another shape or dtype is refused before it is
    installed, and other values than the master's fail the digest of the global it
    announces (the node downloads the weights file instead)."""
    state = {"a": torch.zeros(8), "b": torch.ones(8)}
    held = codec.HeldGlobal.of(0, "run", state)
    new = {"a": torch.full((8,), 0.5), "b": state["b"]}
    wrong = {
        "shape": torch.full((4,), 0.5),
        "dtype": torch.full((8,), 0.5, dtype=torch.float64),
        "values": torch.full((8,), 0.25),
    }[defect]
    update = codec.exact_update({"a": wrong}, ["a"], 0, held.digest)
    update.outer_step, update.run_id, update.digest = 1, "run", codec.state_digest(new)
    path = tmp_path / "update_1.safetensors"
    with open(path, "wb") as handle:
        sha = update.write(handle)
    with pytest.raises(ValueError, match="digest" if defect == "values" else "the global's"):
        codec.read_update(path, held, sha256=sha, outer_step=1, run_id="run", like=state)
    good = codec.exact_update(new, ["a"], 0, held.digest)
    good.outer_step, good.run_id, good.digest = 1, "run", codec.state_digest(new)
    with open(path, "wb") as handle:
        sha = good.write(handle)
    made = codec.read_update(path, held, sha256=sha, outer_step=1, run_id="run", like=state)
    assert torch.equal(made.state["a"], new["a"]) and made.state["b"] is state["b"]
