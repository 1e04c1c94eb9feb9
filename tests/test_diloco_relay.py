"""Hierarchical rounds (issue 17, item 2): group leaders relay their members' mean to the
top-level exchange as one contribution weighing its members, so a round costs G + 1 top-level
commits for K nodes in G groups, and every node still weighs the same."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hub_emulator_fixtures import fast_retry
from process_support import wait_for

from speedtronic.config import DistributedConfig
from speedtronic.diloco.directory import DirectoryTransport
from speedtronic.diloco.exchange import RoundSettings
from speedtronic.diloco.master import RelayStep, RoundMaster
from speedtronic.retry import TransportError


def _settings(**extra) -> DistributedConfig:
    values = dict(outer_lr=1.0, outer_momentum=0.0, round_timeout=30.0, poll_interval=0.02)
    values.update(extra)
    return DistributedConfig(**values)


def _master(tmp, name, transport, upstream=None, **settings):
    events: list = []
    master = RoundMaster(
        transport,
        {"w": torch.zeros(3)},
        settings=RoundSettings.of(_settings(**settings)),
        state_dir=tmp / f"state-{name}",
        emit=lambda e, **fields: events.append((e, fields)),
        outer=upstream,
    )
    master.events = events
    return master


def _member(exchange: DirectoryTransport, node: str, label: int, values) -> None:
    meta = exchange.global_metadata()
    exchange.upload_delta(
        {"w": torch.tensor(values)},
        node_id=node,
        round_index=label,
        local_step=label,
        base_outer_step=label,
        owner={"instance": f"{node}-1", "state": "training"},
        metadata={"run_id": meta.run_id, "instance": f"{node}-1"},
    )


def _wait(predicate, what):
    wait_for(predicate, 20.0, what, interval=0.02)


def test_groups_give_every_node_the_same_weight_and_cut_top_level_commits(tmp_path):
    top = DirectoryTransport(f"file://{tmp_path}/top", fast_retry())
    top.create_repo()
    head = _master(tmp_path, "top", top, relay_leaders=["g1", "g2"])
    groups = {}
    for name in ("g1", "g2"):
        exchange = DirectoryTransport(f"file://{tmp_path}/{name}", fast_retry())
        exchange.create_repo()
        upstream = RelayStep(
            DirectoryTransport(f"file://{tmp_path}/top", fast_retry()),
            node_id=name,
            settings=RoundSettings.of(_settings()),
            record=lambda **status: {"instance": "leader", **status},
            stop=threading.Event(),
        )
        groups[name] = (exchange, _master(tmp_path, name, exchange, upstream))
    head.reconcile()
    for _, relay in groups.values():
        relay.start()
    head.start()
    try:
        g1, g2 = groups["g1"][0], groups["g2"][0]
        _wait(lambda: g1.global_metadata() and g2.global_metadata(), "the groups' global 0")
        assert g1.global_metadata().run_id == top.global_metadata().run_id
        for name in ("a", "b"):  # both members announce themselves before delivering
            g1.claim_owner(name, {"instance": f"{name}-1", "state": "training"})
        g2.claim_owner("c", {"instance": "c-1", "state": "training"})
        _wait(lambda: {"a", "b"} <= set(groups["g1"][1].nodes), "g1 to see its members")
        _member(g1, "a", 0, [1.0, 2.0, 3.0])
        _member(g1, "b", 0, [3.0, 2.0, 1.0])
        _member(g2, "c", 0, [5.0, 5.0, 5.0])
        _wait(lambda: g1.global_metadata().outer_step == 1 == g2.global_metadata().outer_step,
              "global 1 in both groups")  # fmt: skip
        # one contribution per group, weighted by its members: the mean over all three nodes
        expected = -(torch.tensor([1.0, 2.0, 3.0]) + torch.tensor([3.0, 2.0, 1.0]) + 5.0) / 3
        assert torch.allclose(top.read_global()["w"], expected)
        assert torch.equal(g1.read_global()["w"], top.read_global()["w"])
        # each master reports its round after its publish landed: wait for the reports too
        for master in (head, groups["g1"][1]):
            _wait(lambda m=master: any(e == "outer_step" for e, _ in m.events), "round reports")
        rounds = [p for e, p in head.events if e == "outer_step"]
        assert [r["included"] for r in rounds] == [["g1/0", "g2/0"]]
        assert head.ledger == {"g1": 0, "g2": 0}
        relayed = [p for e, p in groups["g1"][1].events if e == "outer_step"]
        assert relayed[0]["included"] == ["a/0", "b/0"] and relayed[0]["nodes_included"] == 2
        # members that end after a round not marked final: each group ends, tells the top
        # level it is done, and the top-level run ends without waiting out drop_after
        for exchange, names in ((g1, ("a", "b")), (g2, ("c",))):
            for name in names:
                exchange.claim_owner(
                    name, {"instance": f"{name}-1", "state": "done", "final_round": 0}
                )
        _wait(lambda: head.finished.is_set(), "the top-level run to end")
        assert all(relay.finished.is_set() for _, relay in groups.values())
        assert {top.read_owner(g)["state"] for g in ("g1", "g2")} == {"done"}
        assert top.global_metadata().final
    finally:
        for _, relay in groups.values():
            relay.outer._stop.set()
            relay.stop()
        head.stop()


def test_a_relay_config_must_be_a_group_master():
    with pytest.raises(ValueError, match="relay_to"):
        DistributedConfig(enabled=True, repo_id="file:///g", role="worker", relay_to="org/top")
    with pytest.raises(ValueError, match="top-level exchange"):
        DistributedConfig(enabled=True, repo_id="file:///g", role="master", relay_to="file:///g")


def test_a_group_publish_that_fails_after_the_mean_went_up_never_sends_it_twice(tmp_path):
    top = DirectoryTransport(f"file://{tmp_path}/top", fast_retry())
    top.create_repo()
    head = _master(tmp_path, "top", top, relay_leaders=["g1"])
    exchange = DirectoryTransport(f"file://{tmp_path}/g1", fast_retry())
    exchange.create_repo()
    stop = threading.Event()
    upstream = RelayStep(
        DirectoryTransport(f"file://{tmp_path}/top", fast_retry()),
        node_id="g1",
        settings=RoundSettings.of(_settings()),
        record=lambda **status: {"instance": "leader", **status},
        stop=stop,
    )
    leader = _master(tmp_path, "g1", exchange, upstream)
    sent = []
    forward = upstream.forward
    upstream.forward = lambda mean, **kw: (sent.append(kw["round"]), forward(mean, **kw))[1]
    head.reconcile()
    head.start()
    try:
        leader.poll_once()
        for name in ("a", "b"):
            exchange.claim_owner(name, {"instance": f"{name}-1", "state": "training"})
        leader.poll_once()
        _member(exchange, "a", 0, [1.0, 2.0, 3.0])
        _member(exchange, "b", 0, [3.0, 2.0, 1.0])
        publish = exchange.publish_global

        def lost(*args, **kwargs):  # the group's own publish fails and does not land
            exchange.publish_global = publish
            raise TransportError("group exchange down")

        exchange.publish_global = lost
        with pytest.raises(TransportError):
            leader.poll_once()  # the mean went up: the top level holds global 1
        assert sent == [0] and top.global_metadata().outer_step == 1
        assert leader.poll_once() is False  # agrees with the exchange: round 0 is closed
        assert exchange.global_metadata().outer_step == 1 and leader.ledger == {"a": 0, "b": 0}
        assert torch.equal(exchange.read_global()["w"], top.read_global()["w"])
        _member(exchange, "a", 1, [1.0, 1.0, 1.0])
        _member(exchange, "b", 1, [1.0, 1.0, 1.0])
        assert leader.poll_once() is True
        assert sent == [0, 1] and head.ledger == {"g1": 1}
        rounds = [p for e, p in leader.events if e == "outer_step"]
        # the members' round-0 files are never folded and sent up a second time
        assert [r["included"] for r in rounds] == [["a/0", "b/0"], ["a/1", "b/1"]]
        assert torch.equal(top.read_global()["w"], torch.tensor([-3.0, -3.0, -3.0]))
    finally:
        stop.set()
        head.stop()


def test_a_leader_s_wait_for_the_first_top_level_global_is_bounded(tmp_path):
    """A group leader started before the top-level master waits at most round_timeout for
    the first top-level global (at startup that wait holds the training thread), then says
    what it waited for and for how long; the master retries it at its next poll."""
    upstream = RelayStep(
        DirectoryTransport(f"file://{tmp_path}/top", fast_retry()),
        node_id="g1",
        settings=RoundSettings.of(_settings(round_timeout=0.3)),
        record=lambda **status: {"instance": "leader", **status},
        stop=threading.Event(),
    )
    upstream.store.create_repo()
    started = time.monotonic()
    with pytest.raises(TransportError, match=r"first top-level global within [0-9.]+ s"):
        upstream.current()
    assert time.monotonic() - started < 10
