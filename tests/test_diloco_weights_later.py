"""A new run's global 0 goes out after its record (issue 38): its nodes hold it already, so the
master publishes the record at once and uploads the weights file on a thread of its own; the
rounds after it publish their updates meanwhile instead of queueing behind 12 MB of fp32
weights on a slow link. Nothing older is ever read for it, no weights file goes over a newer
one, and a failed or lost upload is replaced by the next global's own weights file.
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from hub_emulator_fixtures import fast_retry
from test_diloco_global_update import _link, _same, _state
from test_diloco_global_update import _round as round_of
from test_diloco_master import deliver, join, make_master

from speedtronic.diloco import exchange as T
from speedtronic.diloco.directory import DirectoryTransport
from speedtronic.diloco.master import RoundMaster
from speedtronic.retry import RemoteNotFound, TransportError


class HeldWeights:
    """The exchange's commits of a weights file alone (a :class:`~.exchange.WeightsUpload`)
    wait for :attr:`gate` (a slow link) and fail when :attr:`fail` is set; every commit's
    message is kept in order, and how each weights file alone was committed in :attr:`how`."""

    def __init__(self, t) -> None:
        self.gate, self.fail, self.messages, self.how = threading.Event(), False, [], []
        original = t.commit

        def commit(additions, deletions=(), message="update", **how):
            if set(additions) == {T.GLOBAL_MODEL}:
                self.how.append(how)
                assert self.gate.wait(10)
                if self.fail:
                    raise TransportError("the link went down")
            original(additions, deletions, message, **how)
            self.messages.append(message)

        t.commit = commit


def _announced(tmp_path, fresh=False, **overrides):
    """A master that announced its run (``fresh``: over whatever the exchange holds), a worker
    ``a`` that took global 0 from its own weights, and the round thread's first poll (global
    0's record) with the upload held."""
    master, t, _ = make_master(tmp_path, state=_state(), **overrides)
    master.agreement.fresh = fresh
    join(t, "a")
    join(t, "b")
    held = HeldWeights(t)
    master.reconcile(announce=True)
    link = _link(tmp_path, t, master, "a")
    first, _ = link.first_global("", resumed=False)
    assert first.source == "own"
    assert master.poll_once() is False  # returns with the weights file still on its way
    return master, t, held, link, first


def test_global_0s_record_goes_first_and_the_next_global_does_not_wait_for_its_weights(tmp_path):
    master, t, held, link, first = _announced(tmp_path, global_dtype="int8")
    record = t.global_metadata()
    assert (record.outer_step, record.sha256) == (0, t.announced().sha256)
    assert T.GLOBAL_MODEL not in t.list_files() and t.weights_upload.running
    round_of(master, t, ["a", "b"], 0)  # global 1: an update over global 0, published now
    assert t.weights_upload.running and held.messages[-1] == "outer step 1"
    following = link.fetch((first.outer_step, first.run_id))
    assert following.source == "update"  # the worker holds global 0: nothing else needed
    _same(following, master)
    other = _link(tmp_path, t, master, "c")  # holds no global: it needs the weights file
    with pytest.raises(RemoteNotFound):  # not there yet: a transient miss, retried
        other.fetch((-1, ""))
    held.gate.set()
    assert t.weights_upload.wait(10) and held.messages[-1] == "weights of global 0"
    assert held.how == [{"background": True}]  # it gives way to the rounds' uploads
    late = other.fetch((-1, ""))
    assert late.source == "full"
    _same(late, master)
    master.stop()


def test_a_weights_file_waits_for_the_one_on_its_way_and_never_goes_under_it(tmp_path):
    master, t, held, _link_a, _ = _announced(tmp_path)  # fp32: every global a weights file
    threading.Timer(0.3, held.gate.set).start()
    round_of(master, t, ["a", "b"], 0)  # global 1's weights file, after global 0's
    assert held.messages[-2:] == ["weights of global 0", "outer step 1"]
    record, state = t.fetch_global()
    assert (record.outer_step, record.chain) == (1, ())
    assert torch.equal(state["w"], master.global_state["w"])


def test_the_first_record_deletes_another_runs_weights_file(tmp_path):
    """A new run over an exchange that holds another run's weights file: its global 0's
    record deletes that file, so no reader takes it (its header is of a later step) for the
    new run's global 0 while the new file is on its way."""
    t = DirectoryTransport(f"file://{tmp_path}/repo", fast_retry())
    t.create_repo()
    old = {"w": torch.full_like(_state()["w"], 7.0), "n": torch.tensor(3)}
    t.publish_global(old, outer_step=9, final=True, run_id="old")
    master, t, held, _link_a, _ = _announced(tmp_path, fresh=True, transport=t)
    assert T.GLOBAL_MODEL not in t.list_files()
    with pytest.raises(RemoteNotFound):
        t.fetch_global()
    held.gate.set()
    assert t.weights_upload.wait(10)
    record, state = t.fetch_global()
    assert (record.outer_step, record.run_id) == (0, master.run_id)
    assert torch.equal(state["w"], _state()["w"])


def test_a_failed_weights_upload_is_replaced_by_the_next_globals_weights_file(tmp_path, caplog):
    master, t, held, link, first = _announced(tmp_path, global_dtype="int8")
    held.fail = True
    held.gate.set()
    with caplog.at_level(logging.WARNING, logger="speedtronic.diloco"):
        assert t.weights_upload.wait(10) is False
    assert "could not upload the weights of global 0" in caplog.text
    round_of(master, t, ["a", "b"], 0)
    record, state = t.fetch_global()  # global 1 with a weights file of its own
    assert (record.outer_step, record.chain) == (1, ())
    assert torch.equal(state["w"], master.global_state["w"])
    following = link.fetch((first.outer_step, first.run_id))
    _same(following, master)


def test_a_master_restarted_before_the_weights_landed_sends_its_own_with_the_next_global(
    tmp_path,
):
    """The upload dies with its master (killed while it was on its way): the restarted
    master, over its own outer state, publishes the next global with a weights file."""
    master, t, held, link, first = _announced(tmp_path, global_dtype="int8")
    again = DirectoryTransport(t.repo_id, fast_retry())  # the new process's store
    restarted = RoundMaster(
        again,
        _state(),
        settings=master.settings,
        state_dir=master.outer_files.state_dir,
        emit=master._emit,
        on_final=master.on_final,
        clock=master._clock,
    )
    restarted.finals = master.finals
    assert restarted.poll_once() is False and restarted.outer_step == 0
    round_of(restarted, again, ["a", "b"], 0)
    record, state = again.fetch_global()
    assert (record.outer_step, record.chain) == (1, ())
    assert torch.equal(state["w"], restarted.global_state["w"])
    following = link.fetch((first.outer_step, first.run_id))
    _same(following, restarted)
    held.fail = True  # the killed process's upload never lands
    held.gate.set()
    assert t.weights_upload.wait(10) is False


def test_a_run_that_ends_first_waits_for_the_weights_before_its_final_record(tmp_path):
    """A run shorter than the upload: the final global is published only once the weights
    file its chain starts from is on the exchange (what the run leaves is whole)."""
    master, t, held, _link_a, _ = _announced(tmp_path, global_dtype="int8")
    for node in ("a", "b"):
        deliver(t, node, 0, [0.01] * len(_state()["w"]), final=True)
    threading.Timer(0.3, held.gate.set).start()
    assert master.poll_once() is True and master.finished.is_set()
    assert held.messages.index("weights of global 0") < len(held.messages) - 1
    record, state = t.fetch_global()
    assert record.final and torch.equal(state["w"], master.global_state["w"])
