"""The master's round (speedtronic.diloco.master) against a real shared-volume repository.

Contribution files are planted exactly as nodes write them; time is a fake clock, so every
close decision (complete, timeout, min_nodes, silence) is deterministic.
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from hub_emulator_fixtures import fast_retry

from speedtronic.config import DistributedConfig
from speedtronic.diloco.codec import read_metadata, state_from_bytes
from speedtronic.diloco.directory import DirectoryTransport
from speedtronic.diloco.exchange import RoundSettings
from speedtronic.diloco.master import RoundMaster
from speedtronic.retry import TransportError


class Log:
    """Events, from a master's ``emit(event, **fields)`` or as a coordinator's metrics logger
    (``emit(event, payload)``); lines are read with :func:`lines`."""

    def __init__(self):
        self.events = []

    def emit(self, event, payload=None, /, **fields):
        self.events.append((event, {**(payload or {}), **fields}))

    def of(self, name):
        return [p for e, p in self.events if e == name]


def lines(caplog):
    """The ``speedtronic.diloco`` logger's lines so far, as (level, message)."""
    return [
        (r.levelname.lower(), r.getMessage())
        for r in caplog.records
        if r.name == "speedtronic.diloco"
    ]


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def settings(**overrides):
    values = {
        "outer_lr": 1.0,
        "outer_momentum": 0.0,
        "round_timeout": 10.0,
        "min_nodes": 1,
        "max_staleness": 1,
        "drop_after": 3,
        "inner_steps": 5,
    }
    values.update(overrides)
    return DistributedConfig(**values)


def make_master(tmp_path, transport=None, state=None, clock=None, **overrides):
    log = Log()
    if transport is None:  # the exchange, created as the coordinator creates it
        transport = DirectoryTransport(f"file://{tmp_path}/repo", fast_retry())
        transport.create_repo()
    finals = []
    master = RoundMaster(
        transport,
        state or {"w": torch.zeros(2), "n": torch.tensor(3)},
        settings=RoundSettings.of(settings(**overrides)),
        state_dir=tmp_path / "state",
        emit=log.emit,
        on_final=lambda step, state: finals.append((step, state["w"].tolist())),
        clock=clock or Clock(),
    )
    master.finals = finals
    return master, transport, log


def join(t, node, state="training"):
    t.claim_owner(node, {"instance": f"{node}-1", "state": state})


def bootstrap(master, t, *nodes):
    """``nodes`` join and the master polls once: the initial global is published."""
    for node in nodes:
        join(t, node)
    master.poll_once()


def deliver(t, node, label, values, *, final=False, run_id=None):
    status = {"instance": f"{node}-1", "state": "done" if final else "training"}
    if final:
        status["final_round"] = label
    if run_id is None:  # the run of the published global, as a node would
        meta = t.global_metadata()
        run_id = meta.run_id if meta else ""
    return t.upload_delta(
        {"w": torch.tensor(values)},
        node_id=node,
        round_index=label,
        local_step=5 * (label + 1),
        base_outer_step=label,
        owner=status,
        metadata={"run_id": run_id, "instance": f"{node}-1", "final": str(final).lower()},
    )


def published(t):
    return t.read_global()["w"].tolist()


def test_round_closes_when_every_active_node_delivered(tmp_path):
    master, t, log = make_master(tmp_path)
    join(t, "a")
    join(t, "b")
    assert master.poll_once() is False  # bootstrap; nobody delivered
    assert t.global_metadata().outer_step == 0
    deliver(t, "a", 0, [2.0, 0.0])
    assert master.poll_once() is False  # b is expected and within the timeout
    deliver(t, "b", 0, [4.0, 2.0])
    before = t.commits
    assert master.poll_once() is True
    assert t.commits == before + 1  # publish + prune: one commit
    assert published(t) == [-3.0, -1.0]  # w - lr * mean(deltas), equal weight
    assert t.read_global()["n"].item() == 3  # integer buffers untouched
    assert t.read_ledger() == {"a": 0, "b": 0}
    assert t.delta_paths() == []
    event = log.of("outer_step")[-1]
    assert event["reason"] == "complete" and event["included"] == ["a/0", "b/0"]
    assert (event["outer_step"], event["round"], event["nodes_active"]) == (1, 0, 2)


def test_timeout_closes_without_the_straggler_who_is_folded_in_next_round(tmp_path):
    clock = Clock()
    master, t, log = make_master(tmp_path, clock=clock)
    bootstrap(master, t, "a", "b")
    deliver(t, "a", 0, [2.0, 2.0])
    assert master.poll_once() is False
    clock.now += 9.0
    assert master.poll_once() is False  # 9 s after the first contribution
    clock.now += 1.0
    assert master.poll_once() is True
    assert log.of("outer_step")[-1]["reason"] == "timeout"
    assert published(t) == [-2.0, -2.0]
    # round 1: b's late round-0 file and its round-1 file count as ONE node (their mean)
    deliver(t, "b", 0, [4.0, 4.0])
    deliver(t, "b", 1, [0.0, 2.0])
    deliver(t, "a", 1, [1.0, 1.0])
    assert master.poll_once() is True
    event = log.of("outer_step")[-1]
    assert event["reason"] == "complete" and event["deltas_late"] == 1
    assert event["included"] == ["a/1", "b/0", "b/1"] and event["nodes_included"] == 2
    # mean over nodes: (a=[1,1] + b=mean([4,4],[0,2])=[2,3]) / 2 = [1.5, 2]
    assert published(t) == [-3.5, -4.0]
    assert t.read_ledger() == {"a": 1, "b": 1}


def test_too_late_is_dropped_and_replays_are_never_counted_twice(tmp_path, caplog):
    clock = Clock()
    master, t, log = make_master(tmp_path, clock=clock, max_staleness=0)
    bootstrap(master, t, "a", "b")
    deliver(t, "a", 0, [1.0, 1.0])
    master.poll_once()
    clock.now += 10.0
    assert master.poll_once() is True  # round 0 without b
    path = deliver(t, "b", 0, [100.0, 100.0])  # one round late, max_staleness 0
    deliver(t, "a", 1, [2.0, 2.0])
    deliver(t, "b", 1, [1.0, 1.0])
    assert master.poll_once() is True
    event = log.of("outer_step")[-1]
    assert event["deltas_stale"] == 1 and event["included"] == ["a/1", "b/1"]
    assert published(t) == [-2.5, -2.5]  # the stale contribution changed nothing
    assert path not in t.list_files()
    assert any("1 rounds late" in m for lvl, m in lines(caplog) if lvl == "warning")
    # a replay of an aggregated contribution (a restarted node re-sending) is pruned, not counted
    replay = deliver(t, "a", 1, [50.0, 50.0])
    deliver(t, "a", 2, [1.0, 1.0])
    deliver(t, "b", 2, [3.0, 3.0])
    assert master.poll_once() is True
    assert published(t) == [-4.5, -4.5]
    assert log.of("outer_step")[-1]["deltas_skipped"] == 1
    assert replay not in t.list_files()


def test_min_nodes_holds_a_timed_out_round(tmp_path):
    clock = Clock()
    master, t, _ = make_master(tmp_path, clock=clock, min_nodes=2)
    for node in "abc":
        join(t, node)
    master.poll_once()
    deliver(t, "a", 0, [1.0, 1.0])
    master.poll_once()
    clock.now += 15.0
    assert master.poll_once() is False  # timed out, but only one contribution
    deliver(t, "b", 0, [3.0, 3.0])
    assert master.poll_once() is True
    assert published(t) == [-2.0, -2.0]


def test_silent_node_drops_out_and_rejoins_when_it_delivers(tmp_path):
    clock = Clock()
    master, t, log = make_master(tmp_path, clock=clock)
    bootstrap(master, t, "a", "b")
    clock.now += 31.0  # b (and a) silent for more than drop_after * round_timeout
    deliver(t, "a", 0, [1.0, 1.0])
    assert master.poll_once() is True  # a heard just now; b dropped: nobody to wait for
    assert [p["node_id"] for p in log.of("node_dropped")] == ["b"]
    deliver(t, "a", 1, [2.0, 2.0])
    assert master.poll_once() is True  # still without b
    deliver(t, "b", 2, [2.0, 2.0])  # b is back with a contribution to the open round
    assert master.poll_once() is False  # ... and a is expected
    assert [p["node_id"] for p in log.of("node_rejoined")] == ["b"]
    deliver(t, "a", 2, [1.0, 1.0])
    assert master.poll_once() is True
    assert log.of("outer_step")[-1]["included"] == ["a/2", "b/2"]
    deliver(t, "a", 3, [3.0, 3.0])
    assert master.poll_once() is False  # b is expected again


def test_last_round_publishes_the_final_global(tmp_path):
    master, t, log = make_master(tmp_path)
    bootstrap(master, t, "a", "b")
    deliver(t, "a", 0, [1.0, 1.0], final=True)  # a is done after round 0
    deliver(t, "b", 0, [3.0, 3.0])
    assert master.poll_once() is True
    assert not t.global_metadata().final and not master.finished.is_set()
    deliver(t, "b", 1, [2.0, 2.0], final=True)
    assert master.poll_once() is True  # round 1 waits for b only
    assert log.of("outer_step")[-1]["included"] == ["b/1"]
    meta = t.global_metadata()
    assert meta.final and meta.outer_step == 2 and master.finished.is_set()
    assert master.finals == [(2, [-4.0, -4.0])]


def test_nodes_that_finish_without_a_last_delta_end_the_run(tmp_path):
    master, t, _ = make_master(tmp_path)
    bootstrap(master, t, "a")
    deliver(t, "a", 0, [1.0, 1.0])
    master.poll_once()
    t.claim_owner("a", {"instance": "a-1", "state": "done", "final_round": 0})
    master.poll_once()
    assert t.global_metadata().final and master.finals == [(1, [-1.0, -1.0])]


def test_files_refused_after_the_last_round_are_reported_with_the_final_global(tmp_path):
    master, t, log = make_master(tmp_path)
    bootstrap(master, t, "a")
    deliver(t, "a", 0, [1.0, 1.0])
    assert master.poll_once() is True
    t.claim_owner("a", {"instance": "a-1", "state": "done", "final_round": 0})
    t.commit({"nodes/late/delta_1.safetensors": b"garbage"})  # once every node was done
    master.poll_once()
    master.poll_once()
    assert t.global_metadata().final and master.finished.is_set()
    assert log.of("outer_step")[-1]["deltas_corrupt"] == 0  # no round closed after it
    (report,) = log.of("final_global")
    assert report["deltas_corrupt"] == 1 and report["outer_step"] == 1


def test_restart_mid_round_loses_nothing_and_counts_nothing_twice(tmp_path):
    master, t, _ = make_master(tmp_path)
    bootstrap(master, t, "a", "b")
    deliver(t, "a", 0, [1.0, 1.0])
    deliver(t, "b", 0, [1.0, 1.0])
    master.poll_once()
    deliver(t, "a", 1, [2.0, 2.0])
    master.poll_once()  # round 1 open, a delivered; the master dies here
    again, _, _ = make_master(tmp_path, transport=t)
    assert again.outer_step == 1 and again.ledger == {"a": 0, "b": 0}
    deliver(t, "b", 1, [4.0, 4.0])
    assert again.poll_once() is True
    assert published(t) == [-4.0, -4.0]  # -1 then -3: both rounds once
    meta = read_metadata(tmp_path / "state/outer_state.safetensors")
    assert meta["outer_step"] == "2" and json.loads(meta["ledger"]) == {"a": 1, "b": 1}


@pytest.mark.parametrize("damage", ["corrupt", "lost"])
def test_damaged_local_state_rebuilds_from_the_published_ledger(tmp_path, damage, caplog):
    master, t, _ = make_master(tmp_path, outer_momentum=0.9)
    bootstrap(master, t, "a")
    deliver(t, "a", 0, [0.1, 0.2])
    master.poll_once()
    before = published(t)
    if damage == "corrupt":
        (tmp_path / "state/outer_state.safetensors").write_bytes(b"\x00garbage")
    else:
        shutil.rmtree(tmp_path / "state")  # a lost disk: every file and folder
    deliver(t, "a", 0, [0.1, 0.2])  # its prune was lost: still in the repository
    rebuilt, _, _ = make_master(
        tmp_path, transport=t, state={"w": torch.ones(2), "n": torch.tensor(3)}
    )
    if damage == "corrupt":
        assert any(lvl == "error" and "corrupt local outer state" in m for lvl, m in lines(caplog))
        assert list((tmp_path / "state").glob("*.corrupt-*"))
    assert rebuilt.poll_once() is False  # adopted; the replay is recognised by the ledger
    assert published(t) == before and rebuilt.ledger == {"a": 0}
    assert t.delta_paths() == []


def test_corrupt_delta_is_counted_once_and_pruned(tmp_path, caplog):
    master, t, log = make_master(tmp_path)
    bootstrap(master, t, "a")
    t.commit({"nodes/bad/delta_0.safetensors": b"garbage"})
    deliver(t, "a", 0, [1.0, 1.0])
    assert master.poll_once() is True
    assert published(t) == [-1.0, -1.0]
    assert log.of("outer_step")[-1]["deltas_corrupt"] == 1
    assert any("nodes/bad/delta_0.safetensors" in m for lvl, m in lines(caplog) if lvl == "warning")
    assert "nodes/bad/delta_0.safetensors" not in t.list_files()  # never read again
    deliver(t, "a", 1, [2.0, 2.0])
    master.poll_once()
    assert log.of("outer_step")[-1]["deltas_corrupt"] == 0


def _failing_publish(t):
    original = t.publish_global
    t.publish_global = lambda *a, **k: (_ for _ in ()).throw(TransportError("hub down"))
    return original


def test_a_failed_publish_keeps_the_closed_round_and_publishes_it_again(tmp_path):
    """The master steps its one copy of the global in place (issue 22: memory that is the
    model's), so a failed publish keeps the closed round instead of rolling it back: its
    local state holds it, and the next poll publishes it; the contribution counts once."""
    master, t, log = make_master(tmp_path)
    bootstrap(master, t, "a")
    deliver(t, "a", 0, [1.0, 2.0])
    original = _failing_publish(t)
    with pytest.raises(TransportError):
        master.poll_once()
    assert published(t) == [0.0, 0.0] and t.global_metadata().outer_step == 0
    assert master.outer_step == 1 and master.ledger == {"a": 0}
    t.publish_global = original
    master.poll_once()
    assert published(t) == [-1.0, -2.0] and t.global_metadata().outer_step == 1
    assert t.read_ledger() == {"a": 0} and t.scan().deltas == {}  # consumed and pruned
    rounds = log.of("outer_step")
    assert [r["outer_step"] for r in rounds] == [1] and rounds[0]["deltas_included"] == 1
    deliver(t, "a", 1, [1.0, 1.0])
    assert master.poll_once() is True and published(t) == [-2.0, -3.0]


def test_a_failed_publish_without_local_state_takes_the_exchange_global_again(tmp_path):
    """With no local state to trust (it cannot be written), the master agrees with the
    exchange after a failed publish: it takes the published global back and closes the round
    anew from the files still there."""
    master, t, _ = make_master(tmp_path)
    bootstrap(master, t, "a")
    master.outer_files.save = lambda state: (_ for _ in ()).throw(OSError("read-only"))
    master.agreement.has_local_state = False
    deliver(t, "a", 0, [1.0, 2.0])
    original = _failing_publish(t)
    with pytest.raises(TransportError):
        master.poll_once()
    assert master.outer_step == 0 and master.ledger == {}
    t.publish_global = original
    assert master.poll_once() is True and published(t) == [-1.0, -2.0]
    assert master.outer_step == 1 and t.read_ledger() == {"a": 0}


def test_unreadable_repository_never_bootstraps_over_it(tmp_path):
    master, t, _ = make_master(tmp_path)
    bootstrap(master, t, "a")
    deliver(t, "a", 0, [1.0, 1.0])
    master.poll_once()
    shutil.rmtree(tmp_path / "state")  # a lost disk: every file and folder
    fresh, _, _ = make_master(
        tmp_path, transport=t, state={"w": torch.full((2,), 9.0), "n": torch.tensor(3)}
    )
    t.global_metadata = lambda: (_ for _ in ()).throw(TransportError("outage"))
    with pytest.raises(TransportError):
        fresh.poll_once()
    assert state_from_bytes(t.read_bytes("global/latest.safetensors"))[0]["w"].tolist() == [
        -1.0,
        -1.0,
    ]


def test_min_nodes_waits_for_nodes_that_have_not_announced_themselves_yet(tmp_path):
    clock = Clock()
    master, t, _ = make_master(tmp_path, clock=clock, min_nodes=3)
    bootstrap(master, t, "a", "b")
    deliver(t, "a", 0, [1.0, 1.0])
    deliver(t, "b", 0, [1.0, 1.0])
    assert master.poll_once() is False  # every known node delivered, but only two of three
    join(t, "c")
    deliver(t, "c", 0, [4.0, 4.0])
    assert master.poll_once() is True and published(t) == [-2.0, -2.0]
    # at the end, nodes that are done lower the floor
    deliver(t, "a", 1, [2.0, 2.0], final=True)
    deliver(t, "b", 1, [2.0, 2.0], final=True)
    deliver(t, "c", 1, [1.0, 1.0])
    assert master.poll_once() is True
    deliver(t, "c", 2, [3.0, 3.0], final=True)
    assert master.poll_once() is True and t.global_metadata().final


def test_pure_aggregator_record_is_not_waited_for(tmp_path):
    master, t, _ = make_master(tmp_path)
    join(t, "agg", state="aggregator")
    bootstrap(master, t, "a")
    deliver(t, "a", 0, [1.0, 1.0])
    assert master.poll_once() is True


def test_a_fresh_master_starts_a_new_run_over_a_finished_one(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="speedtronic.diloco")
    master, t, _ = make_master(tmp_path)
    bootstrap(master, t, "a")
    deliver(t, "a", 0, [1.0, 1.0], final=True)
    master.poll_once()
    assert t.global_metadata().final and t.global_metadata().outer_step == 1
    # the same exchange again, with a master that starts training from scratch
    again, _, _ = make_master(tmp_path, transport=t)
    again.agreement.fresh = True
    join(t, "b")
    again.poll_once()
    meta = t.global_metadata()
    assert meta.outer_step == 0 and not meta.final and published(t) == [0.0, 0.0]
    assert t.read_ledger() == {} and t.read_owner("a") is None  # a's done record is gone
    assert t.read_owner("b")["state"] == "training"
    # a re-run over a finished exchange is a normal start: said at INFO, no warning (issue 29)
    assert any("starting a new run" in m for lvl, m in lines(caplog) if lvl == "info")
    deliver(t, "b", 0, [2.0, 2.0])
    assert again.poll_once() is True and published(t) == [-2.0, -2.0]


def test_a_resuming_master_continues_a_finished_run_as_is(tmp_path):
    master, t, _ = make_master(tmp_path)
    bootstrap(master, t, "a")
    deliver(t, "a", 0, [1.0, 1.0], final=True)
    master.poll_once()
    again, _, _ = make_master(tmp_path, transport=t)
    again.poll_once()  # not fresh: adopts the final global, nothing restarts
    assert again.outer_step == 1 and t.global_metadata().final


def test_contributions_of_another_run_are_dropped(tmp_path, caplog):
    master, t, log = make_master(tmp_path)
    bootstrap(master, t, "a", "b")
    run = t.global_metadata().run_id
    assert len(run) == 12 and master.run_id == run
    deliver(t, "a", 0, [1.0, 1.0])
    stray = deliver(t, "b", 0, [50.0, 50.0], run_id="an-old-run")  # computed in another run
    assert master.poll_once() is True  # b delivered (a file exists); its file is refused
    event = log.of("outer_step")[-1]
    assert event["included"] == ["a/0"] and event["dropped"] == ["b/0"]
    assert published(t) == [-1.0, -1.0] and stray not in t.list_files()
    assert any("another run" in m for lvl, m in lines(caplog) if lvl == "warning")
    deliver(t, "b", 1, [1.0, 1.0])  # the same node, now in this run
    deliver(t, "a", 1, [1.0, 1.0])
    assert master.poll_once() is True and published(t) == [-2.0, -2.0]
    assert t.global_metadata().run_id == run  # the run id is kept across rounds


def test_an_outage_of_the_exchange_does_not_drop_every_node_or_end_the_run(tmp_path):
    clock = Clock()
    master, t, log = make_master(tmp_path, clock=clock)
    bootstrap(master, t, "a", "b")
    original = t.scan
    t.scan = lambda: (_ for _ in ()).throw(TransportError("hub down"))
    for _ in range(6):  # 60 s the master cannot read the exchange (drop_after x timeout = 30)
        clock.now += 10.0
        with pytest.raises(TransportError):
            master.poll_once()
    t.scan = original
    deliver(t, "a", 0, [1.0, 1.0])
    assert master.poll_once() is False  # b is still expected: it was not silent, we were blind
    assert log.of("node_dropped") == [] and not t.global_metadata().final
    deliver(t, "b", 0, [3.0, 3.0])
    assert master.poll_once() is True and not master.finished.is_set()


def test_nodes_that_only_went_silent_never_end_the_run(tmp_path):
    clock = Clock()
    master, t, log = make_master(tmp_path, clock=clock)
    bootstrap(master, t, "a", "b")
    deliver(t, "a", 0, [1.0, 1.0])
    deliver(t, "b", 0, [2.0, 2.0])
    master.poll_once()
    clock.now += 100.0  # both silent far beyond drop_after round lengths, none done
    assert master.poll_once() is False
    assert {p["node_id"] for p in log.of("node_dropped")} == {"a", "b"}
    assert not t.global_metadata().final and not master.finished.is_set()  # the run goes on
    deliver(t, "a", 1, [3.0, 3.0])  # a is back; rounds go on without b
    assert master.poll_once() is True and not master.finished.is_set()


def test_a_poll_reads_a_node_record_again_only_when_the_listing_shows_it_changed(tmp_path):
    master, t, _ = make_master(tmp_path)
    reads: list[str] = []
    read_owner = t.read_owner
    t.read_owner = lambda node: reads.append(node) or read_owner(node)
    for node in ("a", "b", "c"):
        join(t, node)
    master.poll_once()
    assert sorted(reads) == ["a", "b", "c"]
    reads.clear()
    for _ in range(5):  # nothing changed: no record read, whatever the number of nodes
        master.poll_once()
    assert reads == []
    join(t, "b", state="done")  # a new version of one record: that one is read again
    master.poll_once()
    assert reads == ["b"] and master.nodes["b"].state == "done"


def test_a_restarted_master_keeps_the_round_length_its_drop_limit_counts_in(tmp_path):
    clock = Clock()
    master, t, _ = make_master(tmp_path, clock=clock)  # drop after 3 x max(10 s, round)
    bootstrap(master, t, "a", "b")
    clock.now += 100.0  # rounds take 100 s
    deliver(t, "a", 0, [1.0, 1.0])
    deliver(t, "b", 0, [1.0, 1.0])
    assert master.poll_once() is True
    again, _, log = make_master(tmp_path, transport=t, clock=clock)
    assert again.state.round_seconds == pytest.approx(100.0)
    again.poll_once()
    clock.now += 60.0  # longer than 3 x round_timeout, much shorter than 3 rounds
    deliver(t, "a", 1, [1.0, 1.0])
    assert again.poll_once() is False  # still waiting for b
    assert log.of("node_dropped") == []


def test_last_progress_moves_with_contributions_records_and_rounds_only(tmp_path):
    clock = Clock()
    master, t, _ = make_master(tmp_path, clock=clock)
    assert master.last_progress == 1000.0  # the master starting
    join(t, "a")
    join(t, "b")
    clock.now = 1001.0
    master.poll_once()
    assert master.last_progress == 1001.0  # records of new nodes
    clock.now = 1002.0
    master.poll_once()
    assert master.last_progress == 1001.0  # nothing new
    deliver(t, "a", 0, [1.0, 1.0])
    clock.now = 1003.0
    assert master.poll_once() is False
    assert master.last_progress == 1003.0  # a contribution arrived
    clock.now = 1004.0
    master.poll_once()
    assert master.last_progress == 1003.0  # the same one seen again is no progress
    deliver(t, "b", 0, [1.0, 1.0])
    clock.now = 1005.0
    assert master.poll_once() is True
    assert master.last_progress == 1005.0
