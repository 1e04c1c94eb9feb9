"""A worker that starts while its master publishes (issue 29): no warning on a normal start.

Every worker of a re-run of the README loop reads the exchange as the master publishes its
new run's first global over the old run's final one. A publish writes the weights first and
the record (``step_count.json``) last, so a worker between the two read the new weights
under the old record: "initial global read failed ... changed while reading", one warning
per worker. The worker now waits for the record that names the new weights.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading

import torch
from hub_emulator_fixtures import fast_retry
from test_diloco_master import settings

from speedtronic.diloco import exchange as T
from speedtronic.diloco.directory import DirectoryTransport
from speedtronic.diloco.exchange import RoundSettings
from speedtronic.diloco.link import NodeClaim, NodeLink


def _store(path) -> DirectoryTransport:
    store = DirectoryTransport(f"file://{path}", fast_retry())
    store.create_repo()
    return store


def _mid_publish(tmp_path):
    """An exchange holding the final global of run ``old`` (outer step 15) with the first
    weights of run ``new`` already in place and their record not yet; returns the store and
    a function that writes the record."""
    old = {"w": torch.zeros(4)}
    new = {"w": torch.ones(4)}
    store = _store(tmp_path / "exchange")
    store.publish_global(old, outer_step=15, final=True, run_id="old")
    staged = _store(tmp_path / "staged")
    staged.publish_global(new, outer_step=0, run_id="new")
    src, dst = tmp_path / "staged" / "global", tmp_path / "exchange" / "global"
    shutil.copyfile(src / "latest.safetensors", dst / "latest.safetensors")

    def finish() -> None:  # as the master writes it: a temp file renamed into place
        shutil.copyfile(src / "step_count.json", dst / "step_count.json.tmp")
        os.replace(dst / "step_count.json.tmp", dst / "step_count.json")

    return store, finish


def _link(tmp_path, store) -> NodeLink:
    return NodeLink(
        store,
        RoundSettings.of(settings(round_timeout=5.0, poll_interval=0.1)),
        claim=NodeClaim("w1", "worker", tmp_path / "w1"),
        max_bytes=T.max_global_bytes({"w": torch.zeros(4)}),
        like={"w": torch.zeros(4)},
        interrupted=threading.Event(),
    )


def test_a_worker_starting_during_the_masters_first_publish_takes_it_without_a_warning(
    tmp_path, caplog
):
    store, finish = _mid_publish(tmp_path)
    timer = threading.Timer(0.3, finish)  # the master's record lands a moment later
    timer.start()
    with caplog.at_level(logging.INFO, logger="speedtronic"):
        candidate, why = _link(tmp_path, store).first_global("", resumed=False)
    timer.join()
    assert why == "" and candidate is not None
    assert (candidate.outer_step, candidate.run_id) == (0, "new")
    assert torch.equal(candidate.state["w"], torch.ones(4))
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == []


def test_a_record_that_never_follows_is_still_reported(tmp_path):
    """Weights that disagree with a record that does not change are not waited on forever:
    the caller gets the error (and retries on its own schedule)."""
    store, _finish = _mid_publish(tmp_path)
    link = _link(tmp_path, store)
    try:
        link.fetch((-1, ""))
    except T.TornRead as exc:
        assert "changed while reading" in str(exc)
    else:
        raise AssertionError("a torn read that never resolves must raise")
