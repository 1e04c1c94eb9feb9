"""A publish whose outcome the master never learns: killed after the exchange applied it, or
its reply lost. Every round the exchange holds is reported exactly once, and the master never
waits on a round the exchange has already closed (speedtronic.diloco.master).
"""

from __future__ import annotations

import json
import shutil

import pytest
from test_diloco_master import Clock, bootstrap, deliver, join, make_master, published

from speedtronic.retry import TransportError


class Killed(BaseException):
    """The process died here (nothing after this line of the master ran)."""


def _two_nodes_delivered(tmp_path):
    master, t, log = make_master(tmp_path)
    bootstrap(master, t, "a", "b")
    deliver(t, "a", 0, [2.0, 0.0])
    deliver(t, "b", 0, [4.0, 2.0])
    return master, t, log


def _publish_then(t, exc):
    original = t.publish_global

    def publish(*args, **kwargs):
        t.publish_global = original
        original(*args, **kwargs)
        raise exc

    t.publish_global = publish


def test_a_master_killed_after_its_publish_landed_reports_the_round_at_restart(tmp_path):
    master, t, log = _two_nodes_delivered(tmp_path)
    _publish_then(t, Killed())
    with pytest.raises(Killed):
        master.poll_once()
    assert log.of("outer_step") == []  # died before it could say so
    assert t.global_metadata().outer_step == 1 and t.delta_paths() == []

    again, _, log2 = make_master(tmp_path, transport=t)
    assert again.poll_once() is False
    (report,) = log2.of("outer_step")
    assert report["recovered"] is True and report["outer_step"] == 1
    assert report["included"] == ["a/0", "b/0"] and report["reason"] == "complete"
    assert again.outer_step == 1 and again.ledger == {"a": 0, "b": 0}
    assert published(t) == [-3.0, -1.0]
    assert not (tmp_path / "state/pending_round.json").exists()
    deliver(t, "a", 1, [1.0, 1.0])
    deliver(t, "b", 1, [1.0, 1.0])
    assert again.poll_once() is True
    assert [r["outer_step"] for r in log2.of("outer_step")] == [1, 2]  # once each


def test_a_master_killed_before_its_publish_landed_closes_the_round_again(tmp_path):
    master, t, _ = _two_nodes_delivered(tmp_path)
    t.publish_global = lambda *a, **k: (_ for _ in ()).throw(Killed())
    with pytest.raises(Killed):
        master.poll_once()
    assert (tmp_path / "state/pending_round.json").exists()

    again, t2, log2 = make_master(tmp_path)  # a fresh transport over the same repository
    assert again.poll_once() is True  # the record is dropped; the contributions are still there
    (report,) = log2.of("outer_step")
    assert "recovered" not in report and report["included"] == ["a/0", "b/0"]
    assert published(t2) == [-3.0, -1.0]


def test_a_lost_reply_to_a_publish_that_landed_never_stalls_the_master(tmp_path):
    master, t, log = _two_nodes_delivered(tmp_path)
    _publish_then(t, TransportError("connection reset after the commit"))
    with pytest.raises(TransportError):
        master.poll_once()
    assert master.outer_step == 1  # the closed round is kept (whether it landed or not)
    assert master.poll_once() is False  # agrees with the exchange: round 0 is closed
    assert master.outer_step == 1 and master.ledger == {"a": 0, "b": 0}
    (report,) = log.of("outer_step")
    assert report["recovered"] is True and report["included"] == ["a/0", "b/0"]
    deliver(t, "a", 1, [1.0, 1.0])
    deliver(t, "b", 1, [1.0, 1.0])
    assert master.poll_once() is True  # the next round closes; nothing counted twice
    assert [r["included"] for r in log.of("outer_step")] == [["a/0", "b/0"], ["a/1", "b/1"]]
    assert published(t) == [-4.0, -2.0]


def test_an_outage_that_begins_with_a_failed_publish_drops_no_node(tmp_path):
    """The master is blind while it cannot re-check the exchange, as when it cannot list it:
    a node that was quiet meanwhile is not counted silent."""
    clock = Clock()
    master, t, log = make_master(tmp_path, clock=clock)
    for node in ("a", "b", "c"):
        join(t, node)
    master.poll_once()
    deliver(t, "a", 0, [2.0, 0.0])
    deliver(t, "b", 0, [4.0, 2.0])
    assert master.poll_once() is False  # c is expected
    clock.now += 10.0  # round_timeout: the round closes without c, and its publish fails
    down = TransportError("hub down")
    original = (t.publish_global, t.global_metadata, t.scan)
    t.publish_global = lambda *a, **k: (_ for _ in ()).throw(down)
    with pytest.raises(TransportError):
        master.poll_once()  # the publish fails: the next poll re-checks the exchange first
    t.global_metadata = t.scan = t.publish_global  # and the exchange stays down
    for _ in range(6):  # 60 s blind: more than drop_after x round_timeout = 30
        clock.now += 10.0
        with pytest.raises(TransportError):
            master.poll_once()
    t.publish_global, t.global_metadata, t.scan = original
    master.poll_once()  # the kept round (without c) is published again
    assert t.global_metadata().outer_step == 1 and t.read_ledger() == {"a": 0, "b": 0}
    assert log.of("node_dropped") == []  # c was not silent: the master was blind
    assert [r["included"] for r in log.of("outer_step")] == [["a/0", "b/0"]]


def test_a_lost_reply_to_the_final_rounds_publish_still_ends_the_run(tmp_path):
    master, t, _ = make_master(tmp_path)
    bootstrap(master, t, "a")
    deliver(t, "a", 0, [1.0, 1.0], final=True)
    _publish_then(t, TransportError("connection reset after the commit"))
    with pytest.raises(TransportError):
        master.poll_once()
    assert t.global_metadata().final and not master.finished.is_set()
    for _ in range(3):
        master.poll_once()
        if master.finished.is_set():
            break
    assert master.finished.is_set() and master.finals == [(1, [-1.0, -1.0])]
    meta = t.global_metadata()
    assert meta.final and meta.outer_step == 1


@pytest.mark.parametrize("disk", ["kept", "lost", "lost, record of the previous version"])
def test_a_master_restarted_over_its_final_global_finishes_at_once(tmp_path, disk):
    master, t, _ = make_master(tmp_path)
    bootstrap(master, t, "a")
    deliver(t, "a", 0, [1.0, 1.0], final=True)
    _publish_then(t, Killed())
    with pytest.raises(Killed):
        master.poll_once()
    if disk.startswith("lost"):
        shutil.rmtree(tmp_path / "state")  # a lost disk: every file and folder
    if disk.endswith("previous version"):  # a ledger only: who finished is not published
        book = {"outer_step": 1, "nodes": {"a": 0}}
        t.commit({"global/processed.json": json.dumps(book).encode()})
    again, _, _ = make_master(tmp_path, transport=t)  # resuming: not fresh
    again.poll_once()
    assert again.finished.is_set() and again.finals == [(1, [-1.0, -1.0])]
    assert t.global_metadata().final and t.global_metadata().outer_step == 1


def test_nodes_done_in_a_round_whose_reply_was_lost_are_not_waited_for(tmp_path):
    master, t, log = make_master(tmp_path)
    bootstrap(master, t, "a", "b")
    deliver(t, "a", 0, [2.0, 2.0], final=True)  # a is done after round 0
    deliver(t, "b", 0, [4.0, 4.0])
    _publish_then(t, TransportError("connection reset after the commit"))
    with pytest.raises(TransportError):
        master.poll_once()
    assert master.poll_once() is False  # agrees with the exchange: round 0 is closed
    deliver(t, "b", 1, [1.0, 1.0], final=True)
    assert master.poll_once() is True  # a finished: round 1 is complete with b alone
    assert log.of("outer_step")[-1]["reason"] == "complete"
    assert t.global_metadata().final and master.finished.is_set()
