"""Whom the master's round waits for, and from when (speedtronic.diloco.master, issues 29
and 31): the nodes a run expects (``distributed.expected_nodes``), a round clock that starts
at the round's first on-time contribution, and drops that hold across a master restart.

Against a real shared-volume repository with a fake clock, as in test_diloco_master.py
(whose helpers plant contributions exactly as nodes write them).
"""

from __future__ import annotations

import json
import logging
import shutil
import time

import pytest
from hub_emulator_fixtures import hub_emulator, make_transport  # noqa: F401
from test_diloco_master import Clock, bootstrap, deliver, join, lines, make_master, published

from speedtronic.diloco.codec import read_metadata
from speedtronic.diloco.master import RoundsStalledError


def test_the_first_round_waits_for_the_expected_nodes_that_have_not_started_yet(tmp_path):
    """The README's loop: the master and one worker delivered round 0 before the second
    worker announced itself. With three nodes expected, the round waits for it."""
    clock = Clock()
    master, t, log = make_master(tmp_path, clock=clock, expected_nodes=3)
    bootstrap(master, t, "m", "w1")
    deliver(t, "m", 0, [1.0, 1.0])
    deliver(t, "w1", 0, [2.0, 2.0])
    assert master.poll_once() is False  # every announced node delivered; one more expected
    clock.now += 5.0
    assert master.poll_once() is False
    join(t, "w2")
    deliver(t, "w2", 0, [3.0, 3.0])
    assert master.poll_once() is True
    event = log.of("outer_step")[-1]
    assert event["reason"] == "complete" and event["included"] == ["m/0", "w1/0", "w2/0"]
    assert published(t) == [-2.0, -2.0]
    assert log.of("nodes_missing") == []


def test_a_slow_start_is_not_a_slow_round(tmp_path):
    """A node that announced itself but is still starting (loading, compiling, on a loaded
    host) holds the first round past round_timeout, up to drop_after x round_timeout after
    the round's first contribution; later rounds close at round_timeout again."""
    clock = Clock()
    master, t, log = make_master(tmp_path, clock=clock, expected_nodes=3)  # 10 s, 3 x 10 s
    for node in ("m", "w1", "w2"):
        join(t, node)
    master.poll_once()
    deliver(t, "m", 0, [1.0, 1.0])
    deliver(t, "w1", 0, [2.0, 2.0])
    assert master.poll_once() is False
    clock.now += 25.0  # past round_timeout, within the start's grace
    assert master.poll_once() is False
    deliver(t, "w2", 0, [3.0, 3.0])
    assert master.poll_once() is True
    assert log.of("outer_step")[-1]["included"] == ["m/0", "w1/0", "w2/0"]
    deliver(t, "m", 1, [2.0, 2.0])
    deliver(t, "w1", 1, [3.0, 3.0])
    master.poll_once()
    clock.now += 10.0  # round 1 is an ordinary round: round_timeout
    assert master.poll_once() is True
    assert log.of("outer_step")[-1]["reason"] == "timeout"


def test_without_expected_nodes_the_first_round_holds_whoever_announced_itself(tmp_path):
    """The default (0) keeps a master alone from waiting for nodes that never come: the
    single-process main job closes its first round at once."""
    master, t, log = make_master(tmp_path)
    bootstrap(master, t, "m")
    deliver(t, "m", 0, [1.0, 1.0])
    assert master.poll_once() is True
    assert log.of("outer_step")[-1]["reason"] == "complete"


def test_expected_nodes_that_never_start_hold_only_the_first_round_and_for_a_bounded_time(
    tmp_path, caplog
):
    """The wait is bounded: drop_after x round_timeout after the round's first contribution
    the round closes with the nodes that came, says how many are missing, and later rounds
    wait only for the nodes that announced themselves."""
    clock = Clock()
    master, t, log = make_master(tmp_path, clock=clock, expected_nodes=3)
    bootstrap(master, t, "m", "w1")
    deliver(t, "m", 0, [1.0, 1.0])
    deliver(t, "w1", 0, [3.0, 3.0])
    assert master.poll_once() is False
    clock.now += 29.0
    assert master.poll_once() is False  # 29 s of the 30 s bound
    clock.now += 1.0
    assert master.poll_once() is True
    assert log.of("outer_step")[-1]["reason"] == "timeout"
    assert log.of("nodes_missing") == [{"outer_step": 0, "expected": 3, "missing": 1}]
    warned = [m for level, m in lines(caplog) if level == "warning" and "expected" in m]
    assert len(warned) == 1 and "1 of the 3 expected nodes" in warned[0], warned
    deliver(t, "m", 1, [2.0, 2.0])
    deliver(t, "w1", 1, [2.0, 2.0])
    assert master.poll_once() is True  # round 1 does not wait for the missing node again
    assert log.of("outer_step")[-1]["reason"] == "complete"
    join(t, "w2")  # a node that starts later joins as any late node does (issue 40):
    master.poll_once()  # waited for once it delivered, so the round it joined in never is
    deliver(t, "m", 2, [3.0, 3.0])
    deliver(t, "w1", 2, [3.0, 3.0])
    assert master.poll_once() is True
    deliver(t, "w2", 3, [1.0, 1.0])
    deliver(t, "m", 3, [1.0, 2.0])
    assert master.poll_once() is False  # w1 is expected; w2's file is in
    deliver(t, "w1", 3, [1.0, 2.0])
    assert master.poll_once() is True
    assert log.of("outer_step")[-1]["included"] == ["m/3", "w1/3", "w2/3"]
    deliver(t, "m", 4, [2.0, 2.0])
    deliver(t, "w1", 4, [2.0, 2.0])
    assert master.poll_once() is False  # w2 is active now
    deliver(t, "w2", 4, [2.0, 2.0])
    assert master.poll_once() is True


def test_the_round_clock_starts_at_the_first_on_time_contribution_not_a_late_one(tmp_path):
    """A straggler's late contribution to the last round arrives while the others still
    train this one: it must not start this round's round_timeout (which would close the
    round on the late file alone, before anyone delivered on time)."""
    clock = Clock()
    master, t, log = make_master(tmp_path, clock=clock)
    bootstrap(master, t, "a", "b")
    deliver(t, "a", 0, [2.0, 2.0])
    master.poll_once()
    clock.now += 10.0
    assert master.poll_once() is True  # round 0 timed out without b
    deliver(t, "b", 0, [4.0, 4.0])  # late: for round 1, while a trains round 1
    assert master.poll_once() is False
    clock.now += 15.0  # longer than round_timeout, nobody delivered round 1 yet
    assert master.poll_once() is False
    deliver(t, "a", 1, [1.0, 1.0])
    assert master.poll_once() is False  # round 1's clock starts now; b is expected
    clock.now += 5.0
    deliver(t, "b", 1, [0.0, 2.0])
    assert master.poll_once() is True
    event = log.of("outer_step")[-1]
    assert event["reason"] == "complete" and event["included"] == ["a/1", "b/0", "b/1"]


@pytest.mark.parametrize("disk", ["kept", "lost"])
def test_a_dropped_node_stays_dropped_across_a_master_restart_until_it_delivers(tmp_path, disk):
    """Issue 31 item 9: the restarted master does not wait drop_after round lengths again
    for a node it had dropped (its outer state, or with a lost disk the records published
    beside the ledger, say so); the node rejoins when it delivers, and a new instance of it
    is waited for again."""
    clock = Clock()
    master, t, log = make_master(tmp_path, clock=clock)
    bootstrap(master, t, "a", "b")
    clock.now += 31.0  # b silent for more than drop_after x round_timeout
    deliver(t, "a", 0, [1.0, 1.0])
    assert master.poll_once() is True
    assert [p["node_id"] for p in log.of("node_dropped")] == ["b"]
    saved = read_metadata(tmp_path / "state/outer_state.safetensors")
    assert json.loads(saved["dropped"]) == {"b": "b-1"}
    assert json.loads((tmp_path / "repo/global/processed.json").read_text())["dropped"] == {
        "b": "b-1"
    }
    master.stop()
    if disk == "lost":
        shutil.rmtree(tmp_path / "state")

    again, _, log = make_master(tmp_path, transport=t, clock=clock)
    again.poll_once()
    deliver(t, "a", 1, [2.0, 2.0])
    assert again.poll_once() is True  # b is not waited for again
    assert log.of("outer_step")[-1]["included"] == ["a/1"]
    assert log.of("node_dropped") == [] and log.of("node_joined") == [
        {"node_id": "a", "outer_step": 1}
    ]
    deliver(t, "b", 2, [3.0, 3.0])  # b delivers: it rejoins, and the drop is forgotten
    assert again.poll_once() is False  # a is expected
    assert [p["node_id"] for p in log.of("node_rejoined")] == ["b"]
    deliver(t, "a", 2, [3.0, 3.0])
    assert again.poll_once() is True
    saved = read_metadata(tmp_path / "state/outer_state.safetensors")
    assert json.loads(saved["dropped"]) == {}
    deliver(t, "a", 3, [4.0, 4.0])
    assert again.poll_once() is False  # b is waited for again


def test_a_new_instance_of_a_dropped_node_is_waited_for_after_a_restart(tmp_path):
    clock = Clock()
    master, t, log = make_master(tmp_path, clock=clock)
    bootstrap(master, t, "a", "b")
    clock.now += 31.0
    deliver(t, "a", 0, [1.0, 1.0])
    assert master.poll_once() is True  # b dropped
    master.stop()
    t.claim_owner("b", {"instance": "b-2", "state": "training"})  # b restarted meanwhile
    again, _, log = make_master(tmp_path, transport=t, clock=clock)
    again.poll_once()
    deliver(t, "a", 1, [2.0, 2.0])
    assert again.poll_once() is True  # the new instance joins a run in progress (issue 40):
    assert {p["node_id"] for p in log.of("node_joined")} == {"a", "b"}
    deliver(t, "b", 2, [1.0, 1.0])  # its first contribution, to the open round
    assert again.poll_once() is False  # b is in: a is expected
    deliver(t, "a", 2, [2.0, 1.0])
    assert again.poll_once() is True
    deliver(t, "a", 3, [1.0, 3.0])
    assert again.poll_once() is False  # the new instance is expected from now on


# -- issue 40: nodes come and go as pods do -----------------------------------------------
def beat(t, node, n):
    t.write_beat(node, {"instance": f"{node}-1", "beat": n})


def test_a_node_that_left_is_not_waited_for_in_the_round_in_progress(tmp_path, caplog):
    """SIGTERM (a scale-down, an eviction): the node's record says it left; the round that
    waited for it closes at the next poll, complete, and the node is reported once. Back
    with --resume, it is waited for once it delivered (its rounds are out of step)."""
    caplog.set_level(logging.INFO, logger="speedtronic.diloco")
    clock = Clock()
    master, t, log = make_master(tmp_path, clock=clock, round_timeout=600.0)
    bootstrap(master, t, "a", "b", "c")
    deliver(t, "a", 0, [1.0, 1.0])
    deliver(t, "c", 0, [3.0, 3.0])
    assert master.poll_once() is False  # b is expected
    t.claim_owner("b", {"instance": "b-1", "state": "left", "resume": True})
    assert master.poll_once() is True  # 0 s later on the fake clock
    assert log.of("outer_step")[-1]["reason"] == "complete"
    assert log.of("node_left") == [{"node_id": "b", "outer_step": 0, "resume": True}]
    left = [m for _, m in lines(caplog) if "left" in m]
    assert len(left) == 1 and "may come back with --resume" in left[0], left
    join(t, "b")  # resumed: the same instance trains again
    deliver(t, "a", 1, [2.0, 2.0])
    deliver(t, "c", 1, [2.0, 3.0])
    assert master.poll_once() is True  # not waited for before it delivered
    assert [p["node_id"] for p in log.of("node_joined")][-1] == "b"
    deliver(t, "b", 2, [1.0, 3.0])
    deliver(t, "a", 2, [3.0, 2.0])
    deliver(t, "c", 2, [3.0, 1.0])
    assert master.poll_once() is True
    assert log.of("outer_step")[-1]["included"] == ["a/2", "b/2", "c/2"]
    deliver(t, "a", 3, [1.0, 2.0])
    deliver(t, "c", 3, [2.0, 1.0])
    assert master.poll_once() is False  # b is waited for again


def test_a_node_whose_beat_stops_is_dropped_after_the_liveness_timeout(tmp_path, caplog):
    """A SIGKILLed node (no goodbye) costs the others the liveness timeout once, whatever
    round_timeout is; a node that beats is waited for however long it is silent."""
    clock = Clock()
    master, t, log = make_master(
        tmp_path, clock=clock, round_timeout=600.0, liveness_timeout=10.0, heartbeat_interval=3
    )
    bootstrap(master, t, "a", "b", "c")
    deliver(t, "a", 0, [1.0, 1.0])
    for n in range(1, 4):  # b and c beat every 3 s; c dies after its first beat
        beat(t, "b", n)
        if n == 1:
            beat(t, "c", n)
        clock.now += 3.0
        assert master.poll_once() is False
    assert log.of("node_dropped") == []
    deliver(t, "b", 0, [2.0, 2.0])
    clock.now += 5.0  # 11 s after the poll that saw c's last beat
    assert master.poll_once() is True
    assert [p["node_id"] for p in log.of("node_dropped")] == ["c"]
    assert log.of("outer_step")[-1]["included"] == ["a/0", "b/0"]
    warned = [m for lvl, m in lines(caplog) if lvl == "warning" and "node c" in m]
    assert "no liveness beat" in warned[0] and "liveness_timeout 10 s" in warned[0], warned
    assert master.membership()[0] == 2  # a and b
    assert sorted(master.membership()[1]) == ["a", "b", "c"]


def test_a_joining_node_reports_its_first_aggregated_contribution(tmp_path, caplog):
    """The time from the node's process start to its first contribution in a global is an
    event and one line (its claim record says when the process started)."""
    caplog.set_level(logging.INFO, logger="speedtronic.diloco")
    clock = Clock()
    master, t, log = make_master(tmp_path, clock=clock)
    bootstrap(master, t, "a")
    deliver(t, "a", 0, [1.0, 1.0])
    assert master.poll_once() is True
    started = time.time() - 5.0
    t.claim_owner("n", {"instance": "n-1", "state": "training", "started": started})
    master.poll_once()
    clock.now += 2.0
    deliver(t, "n", 1, [2.0, 2.0])
    deliver(t, "a", 1, [3.0, 3.0])
    assert master.poll_once() is True
    first = [p for p in log.of("node_first_included") if p["node_id"] == "n"]
    assert len(first) == 1 and first[0]["outer_step"] == 2 and first[0]["since_join_s"] == 2.0
    assert 5.0 <= first[0]["since_start_s"] < 60.0
    deliver(t, "n", 2, [1.0, 3.0])
    deliver(t, "a", 2, [3.0, 1.0])
    assert master.poll_once() is True
    assert len(log.of("node_first_included")) == 2  # a's (round 0) and n's, once each
    said = [m for _, m in lines(caplog) if m.startswith("node n: first contribution")]
    assert len(said) == 1 and "in global 2" in said[0], said


def test_min_nodes_holds_a_round_says_so_and_stops_after_a_bound(tmp_path, caplog):
    """Issue 40: a round never closes with fewer than min_nodes contributing nodes; it
    says so once and, after drop_after x round_timeout, the master stops (exit 1)."""
    clock = Clock()
    master, t, log = make_master(tmp_path, clock=clock, min_nodes=2)  # 3 x 10 s
    bootstrap(master, t, "a", "b")
    deliver(t, "a", 0, [1.0, 1.0])
    t.claim_owner("b", {"instance": "b-1", "state": "left", "resume": False})
    assert master.poll_once() is False
    clock.now += 15.0
    assert master.poll_once() is False
    assert log.of("min_nodes_wait") == [{"outer_step": 0, "nodes": 1, "need": 2}]
    waits = [m for lvl, m in lines(caplog) if "distributed.min_nodes" in m]
    assert len(waits) == 1 and "1 of 2" in waits[0], waits
    clock.now += 16.0
    with pytest.raises(RoundsStalledError, match="min_nodes 2"):
        master.poll_once()
    assert not t.global_metadata().outer_step  # never closed short


def test_on_the_hub_a_beating_node_is_dropped_only_when_a_round_waited_for_it(
    tmp_path,
    make_transport,  # noqa: F811 (the fixture)
):
    """The Hub (a beat is a commit, so a node beats only when the others wait for it): the
    master drops a node that beats only when the open round waited liveness_timeout for it
    with neither a beat nor a contribution; a beat since the round began to wait keeps it
    (round_timeout bounds the round)."""
    t = make_transport("hub")
    t.create_repo()
    clock = Clock()
    master, t, log = make_master(
        tmp_path, transport=t, clock=clock, round_timeout=600.0, liveness_timeout=30.0
    )
    for node in "abc":
        t.claim_owner(node, {"instance": f"{node}-1", "state": "training", "beats": True})
    master.poll_once()
    clock.now += 100.0  # a long round: no beats, none needed while nobody waits
    assert master.poll_once() is False and log.of("node_dropped") == []
    deliver(t, "a", 0, [1.0, 1.0])
    assert master.poll_once() is False  # the round waits for b and c from now on
    clock.now += 20.0
    beat(t, "b", 1)  # b is alive (it saw a's file at two looks)
    assert master.poll_once() is False
    clock.now += 11.0  # 31 s of waiting: c sent nothing
    assert master.poll_once() is False  # b is still expected
    assert [p["node_id"] for p in log.of("node_dropped")] == ["c"]
    deliver(t, "b", 0, [3.0, 3.0])
    assert master.poll_once() is True
    assert log.of("outer_step")[-1]["included"] == ["a/0", "b/0"]


def test_a_node_back_after_it_left_is_not_dropped_for_the_beats_it_missed_while_away(tmp_path):
    clock = Clock()
    master, t, log = make_master(tmp_path, clock=clock, liveness_timeout=10.0)
    bootstrap(master, t, "a", "b")
    beat(t, "b", 1)
    master.poll_once()
    t.claim_owner("b", {"instance": "b-1", "state": "left", "resume": True})
    master.poll_once()
    clock.now += 60.0  # away for a minute: no beats
    join(t, "b")  # back with --resume; its first beat comes after its claim
    master.poll_once()
    assert "b" not in [p["node_id"] for p in log.of("node_dropped")]  # (a: silent 60 s)
    clock.now += 11.0  # and it never beats again: then it is dropped
    master.poll_once()
    assert "b" in [p["node_id"] for p in log.of("node_dropped")]
