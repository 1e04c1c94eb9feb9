"""The edges of a run's life on the master's side (issue 20): identity headers, relay weights,
status records that cannot end a run by themselves, an unusable global at start, and a loop
that neither spins nor floods the log. RoundMaster over a shared-directory exchange."""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch
from process_support import wait_for
from test_diloco_master import Clock, bootstrap, deliver, join, lines, make_master, published

from speedtronic.config import ConfigError
from speedtronic.diloco import exchange as T
from speedtronic.diloco import master as master_module
from speedtronic.diloco.codec import state_to_bytes
from speedtronic.diloco.exchange import ExchangeError
from speedtronic.diloco.ledger import IDENTITY_HEADERS
from speedtronic.retry import AccessRefused, TransportError

# -- identity headers and relay weights -----------------------------------------------------


def _plant(t, node, round, values, *, drop=(), **extra):
    """A contribution as a node writes it, less the headers in ``drop``."""
    header = {
        "node_id": node,
        "round": round,
        "local_step": 5 * (round + 1),
        "base_outer_step": round,
        "algorithm": "dumb_diloco",
        "dtype": "fp32",
        "run_id": t.global_metadata().run_id,
        "instance": f"{node}-1",
        **extra,
    }
    for key in drop:
        header.pop(key)
    path = T.delta_path(node, round)
    t.commit({path: state_to_bytes({"w": torch.tensor(values)}, metadata=header)})
    return path


@pytest.mark.parametrize("missing", IDENTITY_HEADERS)
def test_a_contribution_missing_an_identity_header_is_refused_and_counted(
    tmp_path, missing, caplog
):
    master, t, log = make_master(tmp_path)
    bootstrap(master, t, "a", "b")
    deliver(t, "a", 0, [1.0, 1.0])
    bad = _plant(t, "b", 0, [100.0, 100.0], drop=(missing,))
    assert master.poll_once() is True  # b delivered a file: the round is complete, b refused
    event = log.of("outer_step")[-1]
    assert event["included"] == ["a/0"] and event["deltas_corrupt"] == 1
    assert published(t) == [-1.0, -1.0] and bad not in t.list_files()
    assert any(missing in m and bad in m for lvl, m in lines(caplog) if lvl == "warning")


def test_weight_counts_only_from_a_configured_relay_leader(tmp_path, caplog):
    master, t, log = make_master(tmp_path, relay_leaders=["leader"])
    for node in ("leader", "solo", "cheat"):
        join(t, node)
    master.poll_once()
    _plant(t, "leader", 0, [1.0, 1.0], weight="3")
    _plant(t, "solo", 0, [5.0, 5.0])
    cheat = _plant(t, "cheat", 0, [1e6, 1e6], weight="999999")
    assert master.poll_once() is True
    event = log.of("outer_step")[-1]
    assert event["included"] == ["leader/0", "solo/0"] and event["deltas_corrupt"] == 1
    assert published(t) == [-2.0, -2.0]  # (3 * 1 + 1 * 5) / 4: the leader's weight counted
    assert cheat not in t.list_files()
    assert any("relay_leaders" in m for lvl, m in lines(caplog) if lvl == "warning")


def test_relay_leaders_is_validated():
    from speedtronic.config import DistributedConfig

    assert DistributedConfig(relay_leaders=["g1", "g2"]).relay_leaders == ["g1", "g2"]
    with pytest.raises(ConfigError, match=r"distributed\.relay_leaders"):
        DistributedConfig(relay_leaders="g1")
    with pytest.raises(ConfigError, match=r"distributed\.relay_leaders"):
        DistributedConfig(relay_leaders=["../escape"])


# -- the end of a run comes from what was aggregated ---------------------------------------


def test_a_forged_done_record_of_a_node_with_nothing_aggregated_does_not_end_the_run(tmp_path):
    master, t, _ = make_master(tmp_path)
    join(t, "a")
    master.poll_once()  # a announced itself: the run has begun
    t.claim_owner("a", {"instance": "a-1", "state": "done", "final_round": -1})
    for _ in range(3):
        assert master.poll_once() is False
    assert not master.finished.is_set() and not t.global_metadata().final
    deliver(t, "a", 0, [1.0, 1.0])  # the node was training all along
    assert master.poll_once() is True and published(t) == [-1.0, -1.0]


def test_a_forged_done_record_of_another_instance_does_not_end_the_run(tmp_path):
    master, t, _ = make_master(tmp_path)
    bootstrap(master, t, "a")
    deliver(t, "a", 0, [1.0, 1.0])
    assert master.poll_once() is True
    t.claim_owner("a", {"instance": "forger", "state": "done", "final_round": 0})
    for _ in range(3):
        master.poll_once()
    assert not master.finished.is_set() and not t.global_metadata().final
    assert master.finals == []


def test_the_genuine_ends_still_end_the_run(tmp_path):
    """A final contribution; and a done record after an all-zero last delta (the node sends
    only the record, naming its last aggregated round)."""
    master, t, _ = make_master(tmp_path)
    bootstrap(master, t, "a", "b")
    deliver(t, "a", 0, [1.0, 1.0], final=True)
    deliver(t, "b", 0, [3.0, 3.0])
    assert master.poll_once() is True and not master.finished.is_set()
    t.claim_owner("b", {"instance": "b-1", "state": "done", "final_round": 0})
    assert master.poll_once() is False
    assert master.finished.is_set() and t.global_metadata().final
    assert master.finals == [(1, [-2.0, -2.0])]


def test_a_restarted_master_still_knows_which_nodes_finished(tmp_path):
    master, t, _ = make_master(tmp_path)
    bootstrap(master, t, "a", "b")
    deliver(t, "a", 0, [1.0, 1.0], final=True)  # a is done after round 0
    deliver(t, "b", 0, [3.0, 3.0])
    assert master.poll_once() is True
    again, _, _ = make_master(tmp_path, transport=t)  # killed and restarted with its state
    again.poll_once()
    deliver(t, "b", 1, [2.0, 2.0], final=True)
    assert again.poll_once() is True  # round 1 waits for b only: a finished (persisted)
    assert again.finished.is_set() and t.global_metadata().final


# -- an unusable global at start ---------------------------------------------------------


def _plant_global(t, state, outer_step=5, garbage=False):
    """A global newer than the master's, published by someone else (or garbage bytes)."""
    run = t.global_metadata().run_id if t.global_metadata() else "r"
    t.publish_global(state, outer_step=outer_step, run_id=run)
    if garbage:
        t.commit({"global/latest.safetensors": b"\x00garbage, not a safetensors file"})


@pytest.fixture
def quick_reads(monkeypatch):
    from speedtronic.diloco import ledger

    monkeypatch.setattr(ledger, "CORRUPT_WAIT", 0.01)


@pytest.mark.parametrize("damage", ["garbage", "non-finite"])
def test_an_unusable_global_and_no_local_state_is_one_typed_error(tmp_path, damage, quick_reads):
    master, t, _ = make_master(tmp_path, state={"w": torch.zeros(2, dtype=torch.float16)})
    if damage == "garbage":
        _plant_global(t, {"w": torch.zeros(2)}, garbage=True)
    else:  # finite in the file's float32, inf in the model's float16
        _plant_global(t, {"w": torch.tensor([1e5, 0.0])})
    with pytest.raises(ExchangeError) as raised:
        master.poll_once()
    message = str(raised.value)
    assert isinstance(raised.value, ConfigError) and "\n" not in message
    assert "global/latest.safetensors" in message and str(tmp_path / "repo") in message
    assert "distributed.repo_id" in message


@pytest.mark.parametrize("damage", ["garbage", "non-finite"])
def test_an_unusable_global_is_replaced_by_the_masters_own_state(
    tmp_path, damage, quick_reads, caplog
):
    state = {"w": torch.zeros(2, dtype=torch.float16)}
    master, t, _ = make_master(tmp_path, state=state)
    bootstrap(master, t, "a")
    deliver(t, "a", 0, [1.0, 2.0])
    assert master.poll_once() is True  # outer step 1, saved in state_dir
    if damage == "garbage":
        _plant_global(t, {"w": torch.zeros(2, dtype=torch.float16)}, garbage=True)
    else:
        _plant_global(t, {"w": torch.tensor([1e5, 0.0])})
    again, _, _ = make_master(tmp_path, transport=t, state=state)
    assert again.poll_once() is False
    assert again.outer_step == 1 and t.global_metadata().outer_step == 1
    assert published(t) == [-1.0, -2.0]
    assert any(lvl == "error" and "unusable" in m for lvl, m in lines(caplog))


def _run_until_fatal(master) -> None:
    """Start the master's thread and wait (bounded) until it stored a fatal error and ended."""
    master.start()
    try:
        wait_for(lambda: master.fatal is not None, 30.0, "the master's fatal error", interval=0.02)
        wait_for(lambda: not master._loop.running, 30.0, "the master thread to end")
    finally:
        master.stop()


def test_a_master_thread_stops_on_a_fatal_error_instead_of_looping(tmp_path, quick_reads, caplog):
    master, t, _ = make_master(tmp_path, poll_interval=0.01)
    _plant_global(t, {"w": torch.zeros(2), "n": torch.tensor(3)}, garbage=True)
    _run_until_fatal(master)
    assert isinstance(master.fatal, ExchangeError) and not master.finished.is_set()
    assert len([m for lvl, m in lines(caplog) if "master round" in m]) == 0


def test_a_master_thread_stops_when_the_exchange_refuses_its_token(tmp_path, monkeypatch):
    """A token revoked mid-run (401/403, or 404 for the repository) is not an outage: the
    thread stops with the error instead of retrying it forever, for the node to exit 2."""
    master, t, _ = make_master(tmp_path, poll_interval=0.01)
    master.poll_once()

    def refused():
        raise AccessRefused("repository org/r: the token is refused (HTTP 401)", status=401)

    monkeypatch.setattr(t, "scan", refused)
    _run_until_fatal(master)
    assert isinstance(master.fatal, AccessRefused) and not master.finished.is_set()


# -- a loop that retries quietly -------------------------------------------------------------


def test_a_failure_that_repeats_is_logged_once_then_every_so_often(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="speedtronic.diloco")  # the recovery line is INFO
    master, t, _ = make_master(tmp_path, poll_interval=0.01)
    master.poll_once()
    polls = []
    original = t.scan

    def down():
        polls.append(time.monotonic())
        raise TransportError("hub down")

    t.scan = down
    master.start()
    try:
        wait_for(lambda: len(polls) >= 40, 60.0, "40 failed polls", interval=0.02)
        failing = [m for lvl, m in lines(caplog) if "master round" in m]
        assert len(failing) == 1 and "hub down" in failing[0]  # not a line per poll
        monkeypatch.setattr(master_module, "FAILURE_LOG_SECONDS", 0.0)
        count = len(polls)
        wait_for(lambda: len(polls) >= count + 2, 60.0, "two more failed polls", interval=0.02)
        assert any("still failing after" in m for lvl, m in lines(caplog))
        t.scan = original
        wait_for(
            lambda: any("works again" in m for lvl, m in lines(caplog)), 60.0, "the recovery line"
        )
    finally:
        master.stop()
    assert master.fatal is None


# -- state written before this change still loads -------------------------------------------


def test_an_outer_state_file_of_2_1_loads_with_its_momentum(tmp_path):
    (tmp_path / "state").mkdir()
    tensors = {
        "global/w": torch.tensor([4.0, 5.0]),
        "global/n": torch.tensor(3),
        "momentum/w": torch.tensor([0.5, -0.5]),
    }
    meta = {
        "format": "speedtronic-outer-state/2",
        "outer_step": 7,
        "run_id": "old-run",
        "ledger": json.dumps({"a": 6}),
        "digests": json.dumps({"a": "x"}),
    }
    (tmp_path / "state/outer_state.safetensors").write_bytes(state_to_bytes(tensors, metadata=meta))
    master, _, _ = make_master(tmp_path, outer_momentum=0.9, clock=Clock())
    assert master.outer_step == 7 and master.run_id == "old-run" and master.ledger == {"a": 6}
    assert master.global_state["w"].tolist() == [4.0, 5.0]
    buffers = master.state.optimizer.momentum_buffers()
    assert buffers["w"].tolist() == [0.5, -0.5]
