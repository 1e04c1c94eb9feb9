"""The master's adaptive outer step and final average (issue 33): eta from the contributions it
sums, the same eta after a restart, and the final global as the mean of the last globals, kept
on disk across a restart. RoundMaster over a shared-directory exchange."""

from __future__ import annotations

import types

import pytest
import torch
from test_diloco_master import bootstrap, deliver, make_master, published
from test_diloco_master_publish_loss import Killed, _publish_then

from speedtronic.diloco.codec import load_safetensors


def _adaptive_round(tmp_path, **overrides):
    """Two orthogonal contributions: spread 4, ||mean||^2 2, so eta = 0.75 * 4 / 2 = 1.5."""
    master, t, log = make_master(tmp_path, outer_step="adaptive", **overrides)
    bootstrap(master, t, "a", "b")
    deliver(t, "a", 0, [2.0, 0.0])
    deliver(t, "b", 0, [0.0, 2.0])
    return master, t, log


def test_the_adaptive_master_steps_with_eta_and_records_it(tmp_path):
    master, t, log = _adaptive_round(tmp_path)
    assert master.poll_once() is True
    (event,) = log.of("outer_step")
    assert event["eta"] == 1.5
    assert published(t) == [-1.5, -1.5]  # plain averaging would give [-1, -1]
    record = t.read_json("global/step_count.json", default={})
    assert record["eta"] == "1.5"


def test_the_cap_bounds_eta(tmp_path):
    master, t, log = _adaptive_round(tmp_path, adaptive_c=4.0, adaptive_max=2.5)
    assert master.poll_once() is True
    assert log.of("outer_step")[0]["eta"] == 2.5  # 4 * 4 / 2 = 8, capped
    assert published(t) == [-2.5, -2.5]


def test_a_restarted_master_reports_and_keeps_the_same_eta(tmp_path):
    master, t, _ = _adaptive_round(tmp_path)
    _publish_then(t, Killed())
    with pytest.raises(Killed):
        master.poll_once()
    again, _, log = make_master(tmp_path, transport=t, outer_step="adaptive")
    assert again.poll_once() is False
    (report,) = log.of("outer_step")
    assert report["recovered"] is True and report["eta"] == 1.5  # the write-ahead record's
    assert again.state.eta == 1.5 and published(t) == [-1.5, -1.5]


def test_a_master_killed_before_its_publish_computes_the_same_eta_again(tmp_path):
    master, t, _ = _adaptive_round(tmp_path)
    t.publish_global = lambda *a, **k: (_ for _ in ()).throw(Killed())
    with pytest.raises(Killed):
        master.poll_once()
    again, t2, log = make_master(tmp_path, outer_step="adaptive")
    assert again.poll_once() is True
    assert log.of("outer_step")[0]["eta"] == 1.5 and published(t2) == [-1.5, -1.5]


def test_the_final_global_is_the_mean_of_the_last_two(tmp_path):
    state = {"w": torch.zeros(2, dtype=torch.bfloat16), "n": torch.tensor(3)}
    master, t, _ = make_master(tmp_path, state=state, final_average=2)
    bootstrap(master, t, "a", "b")
    deliver(t, "a", 0, [2.0, 0.0])
    deliver(t, "b", 0, [4.0, 2.0])
    assert master.poll_once() is True  # global 1: [-3, -1]
    deliver(t, "a", 1, [1.0, 1.0], final=True)
    deliver(t, "b", 1, [1.0, 1.0], final=True)
    assert master.poll_once() is True  # global 2: [-4, -2], the run's last
    assert t.global_metadata().final and master.finished.is_set()
    assert published(t) == [-3.5, -1.5]  # (global 1 + global 2) / 2
    assert master.finals == [(2, [-3.5, -1.5])]
    kept = sorted(p.name for p in (tmp_path / "state/globals").iterdir())
    assert kept == ["1.safetensors", "2.safetensors"]  # global 0 is no longer needed
    assert load_safetensors(tmp_path / "state/globals/2.safetensors")["w"].dtype == torch.float32


def test_the_kept_globals_survive_a_restart(tmp_path):
    master, t, _ = make_master(tmp_path, final_average=2)
    bootstrap(master, t, "a", "b")
    deliver(t, "a", 0, [2.0, 0.0])
    deliver(t, "b", 0, [4.0, 2.0])
    assert master.poll_once() is True  # global 1: [-3, -1]; global 0 kept on disk
    again, _, _ = make_master(tmp_path, transport=t, final_average=2)
    again.poll_once()
    for node in ("a", "b"):  # both done, nothing left: the master publishes the final global
        t.claim_owner(node, {"instance": f"{node}-1", "state": "done", "final_round": 0})
    assert again.poll_once() is False and again.finished.is_set()
    assert t.global_metadata().final
    assert published(t) == [-1.5, -0.5]  # (global 0 + global 1) / 2
    again.poll_once()  # a later poll publishes nothing new
    assert published(t) == [-1.5, -0.5]


def test_the_final_mean_is_scored_like_every_global(tmp_path):
    """Every node done with nothing left to send: the master publishes the mean of the last
    two globals as the final model, a model no round scored, and scores it (``final``)."""

    def score(state):  # the held-out "loss" of a global: the sum of its weights
        total = float(state["w"].sum())
        return types.SimpleNamespace(loss=total, perplexity=1.0, tokens=8)

    master, t, log = make_master(tmp_path, final_average=2)
    master.evaluate = score
    bootstrap(master, t, "a", "b")
    deliver(t, "a", 0, [2.0, 0.0])
    deliver(t, "b", 0, [4.0, 2.0])
    assert master.poll_once() is True  # global 1: [-3, -1]
    for node in ("a", "b"):
        t.claim_owner(node, {"instance": f"{node}-1", "state": "done", "final_round": 0})
    assert master.poll_once() is False and master.finished.is_set()
    scores = [(e["outer_step"], e["loss"], e["final"]) for e in log.of("eval")]
    assert scores == [(1, -4.0, False), (1, -2.0, True)]  # the mean: [-1.5, -0.5]
