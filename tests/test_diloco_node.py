"""Goldens for a node's round (speedtronic.diloco.node): contribution arithmetic, round labels,
carry, the overlapped merge (each step of progress counted exactly once), late globals, the
end of a run, checkpointed state, and the optimizer hook.

The "training" here is explicit: a test moves the weights by known amounts and calls the
per-step hook, so every number is exact.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from speedtronic.config import DistributedConfig
from speedtronic.diloco import node as node_module
from speedtronic.diloco.exchange import RoundSettings
from speedtronic.diloco.node import (
    Contribution,
    DiLoCoNode,
    GlobalCandidate,
    GlobalInbox,
    MergeDue,
)


class Recorder:
    """Collects events and the contributions a node sends; ``on_send`` may act as a master."""

    def __init__(self):
        self.events: list[tuple[str, dict]] = []
        self.sent: list[Contribution] = []
        self.fail_next = 0
        self.fail_after = 0.0  # seconds a failing upload takes (an upload on its own thread)
        self.on_send = None

    def emit(self, event, /, **fields):
        self.events.append((event, fields))

    def send(self, job):
        if self.fail_next:
            self.fail_next -= 1
            time.sleep(self.fail_after)
            raise ConnectionError("exchange down")
        self.sent.append(job)
        if self.on_send is not None:
            self.on_send(job)
        return 123

    def names(self):
        return [name for name, _ in self.events]


def make_node(
    *,
    sync="blocking",
    inner=2,
    timeout=0.2,
    reset=False,
    model=None,
    overlap=None,
    fragments=1,
    threaded=False,
):
    settings = DistributedConfig(
        inner_steps=inner,
        sync=sync,
        round_timeout=timeout,
        reset_inner_optimizer=reset,
        async_delta_upload=threaded,
        overlap_steps=overlap,
        fragments=fragments,
    )
    if model is None:
        model = torch.nn.Linear(2, 1, bias=False)
        with torch.no_grad():
            model.weight.zero_()
    rec = Recorder()
    inbox = GlobalInbox(None, interval=0.01, threaded=False)
    node = DiLoCoNode(RoundSettings.of(settings), model, send=rec.send, inbox=inbox, emit=rec.emit)
    return node, rec, model


def train(model, amount):
    """One inner step that adds ``amount`` to every weight."""
    with torch.no_grad():
        model.weight.add_(amount)


def weights(model):
    return model.weight.detach().flatten().tolist()


def offer(node, step, value, final=False):
    node.inbox.offer(
        GlobalCandidate(step, {"weight": torch.full((1, 2), float(value))}, final=final)
    )


def offer_state(node, step, state, final=False):
    node.inbox.offer(GlobalCandidate(step, {k: v.clone() for k, v in state.items()}, final=final))


def add_all(model, amount):
    """One inner step that adds ``amount`` to every tensor of ``model``."""
    with torch.no_grad():
        for value in model.state_dict().values():
            value.add_(amount)


def master_for_state(node):
    """A one-node master: global ``round + 1`` = the last global minus the contribution, for
    the tensors it holds (a fragment's, or every one), published right away."""
    held = {}

    def publish(job):
        if not held:
            held.update({k: torch.zeros_like(v) for k, v in node.model.state_dict().items()})
        for key, value in job.delta.items():
            held[key] = held[key] - value
        offer_state(node, job.round + 1, held, final=job.final)

    return publish


def started_node(**settings):
    """`make_node` (with ``settings``) that has installed global 0, all zeros."""
    node, rec, model = make_node(**settings)
    offer(node, 0, 0.0)
    node.merge_waiting()
    return node, rec, model


def fragmented_node(**settings):
    """`make_node` with ``fragments: 2`` over a two-layer model (3 tensors, 2 fragments), all
    zeros, ``inner_steps`` 4 (rounds of 2 steps), that has installed global 0."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2, bias=False), torch.nn.Linear(2, 1))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    node, rec, model = make_node(model=model, inner=4, fragments=2, **settings)
    offer_state(node, 0, {k: torch.zeros_like(v) for k, v in model.state_dict().items()})
    node.merge_waiting()
    return node, rec, model


def master_for(node, value_of):
    """A send hook that publishes global ``label + 1`` = ``value_of(job)`` right away."""

    def publish(job):
        offer(node, job.round + 1, value_of(job))

    return publish


def test_blocking_round_golden():
    node, rec, model = make_node()
    offer(node, 0, 10.0)
    node.merge_waiting()
    assert node.rounds.installed == 0 and weights(model) == [10.0, 10.0]
    rec.on_send = master_for(node, lambda job: 10.0 - job.delta["weight"][0, 0].item())
    train(model, 1.0)
    assert node.after_optimizer_step() is False and not rec.sent
    train(model, 2.0)
    node.after_optimizer_step()  # boundary: contribution, then wait for global 1
    job = rec.sent[0]
    assert (job.round, job.base, job.step, job.final) == (0, 0, 2, False)
    assert job.delta["weight"].tolist() == [[-3.0, -3.0]]  # anchor 10 - weights 13
    # blocking: global 1 (= 13, one node, plain averaging) installed before training resumes
    assert node.rounds.installed == 1 and weights(model) == [13.0, 13.0]
    waits = [p for n, p in rec.events if n == "sync_wait"]
    assert [(w["outer_step"], w["timed_out"]) for w in waits] == [(1, False)]
    train(model, 1.0)
    node.after_optimizer_step()
    train(model, 1.0)
    node.after_optimizer_step()
    assert [j.round for j in rec.sent] == [0, 1]
    assert rec.sent[1].delta["weight"].tolist() == [[-2.0, -2.0]]


def test_overlapped_merge_keeps_progress_since_upload_exactly_once():
    node, rec, model = started_node(sync="overlapped", overlap=1)
    train(model, 1.0)
    node.after_optimizer_step()
    train(model, 1.0)
    node.after_optimizer_step()  # upload round 0 (delta -2), keep training
    assert [j.round for j in rec.sent] == [0] and node.rounds.installed == 0
    train(model, 0.5)  # progress after the upload, before global 1 arrives
    offer(node, 1, 100.0)  # the master's global 1
    assert node.after_optimizer_step() is True  # merged at this step (overlap_steps 1)
    assert weights(model) == [100.5, 100.5]  # G1 + 0.5: the step after the upload is kept
    train(model, 0.25)
    node.after_optimizer_step()  # boundary of round 1
    job = rec.sent[1]
    assert (job.round, job.base) == (1, 1)
    # contribution to round 1 = everything since the round-0 upload, once: 0.5 + 0.25
    assert job.delta["weight"].tolist() == [[-0.75, -0.75]]
    total = sum(j.delta["weight"][0, 0].item() for j in rec.sent)
    assert total == pytest.approx(-(1.0 + 1.0 + 0.5 + 0.25))


def test_a_node_on_a_copy_asks_for_the_weights_only_when_its_round_reads_them():
    """Sharded ranks (FSDP): the model is a copy refreshed only when ``wants_weights`` says so;
    a global that arrives after the question waits for the next step, never merging into a
    stale copy, and the result equals the hooked node's golden above."""
    node, rec, copy = make_node(sync="overlapped", inner=3, overlap=2)
    offer(node, 0, 0.0)
    node.merge_waiting()
    live = torch.zeros(1, 2)  # the sharded weights, which the copy lags between refreshes

    def step(amount, *, arrives=None):
        live.add_(amount)
        wants = node.wants_weights()
        if arrives is not None:  # lands between the question and the step
            offer(node, *arrives)
        if wants:
            with torch.no_grad():
                copy.weight.copy_(live)
        merged = node.after_optimizer_step(weights_current=wants)
        if merged:
            live.copy_(copy.weight.detach())
        return wants, merged

    assert step(1.0) == (False, False) and step(1.0) == (False, False)
    assert step(1.0) == (True, False)  # boundary: upload round 0 from the refreshed copy
    assert rec.sent[0].delta["weight"].tolist() == [[-3.0, -3.0]]
    assert step(0.5, arrives=(1, 100.0)) == (False, False)  # copy stale: the global waits
    assert node.rounds.installed == 0
    assert step(0.25) == (True, True)  # refreshed, merged: G1 + the 0.75 since the upload
    assert live.tolist() == [[100.75, 100.75]]
    assert step(0.25) == (True, False)  # boundary of round 1
    assert rec.sent[1].delta["weight"].tolist() == [[-1.0, -1.0]]  # 0.5 + 0.25 + 0.25, once


def test_an_early_global_is_held_until_its_step_so_every_node_merges_it_at_the_same_step():
    """``overlap_steps`` 3 of a 4-step round: global 1 arrives one step after the upload, but
    is merged three steps after it (not before, whatever the timing: every node and the
    ideal arithmetic merge at the same step); progress since the upload is kept once."""
    node, rec, model = started_node(sync="overlapped", inner=4, overlap=3)
    for _ in range(4):
        train(model, 1.0)
        node.after_optimizer_step()  # the fourth uploads round 0 (delta -4)
    train(model, 0.5)
    offer(node, 1, 100.0)  # early: held
    assert node.after_optimizer_step() is False and node.rounds.installed == 0
    train(model, 0.5)
    assert node.after_optimizer_step() is False and weights(model) == [5.0, 5.0]
    train(model, 0.5)
    assert node.after_optimizer_step() is True  # its step: upload + 3
    assert node.rounds.installed == 1 and weights(model) == [101.5, 101.5]
    train(model, 0.5)
    node.after_optimizer_step()  # boundary of round 1: the 2.0 since the upload, once
    assert [(j.round, j.base) for j in rec.sent] == [(0, 0), (1, 1)]
    assert rec.sent[1].delta["weight"].tolist() == [[-2.0, -2.0]]


def test_a_late_global_is_awaited_at_its_step_and_the_wait_reported():
    """The global of the last contribution has not arrived at its step: the node waits
    there (bounded by ``round_timeout``), reports the wait and merges it when it lands."""
    node, rec, model = started_node(sync="overlapped", inner=2, overlap=1, timeout=5.0)
    rec.on_send = master_for(node, lambda job: 50.0)  # published as the upload lands
    for _ in range(2):
        train(model, 1.0)
        node.after_optimizer_step()
    assert node.rounds.installed == 0  # not merged at the upload's step
    train(model, 1.0)
    assert node.after_optimizer_step() is True and weights(model) == [51.0, 51.0]
    waits = [p for n, p in rec.events if n == "sync_wait"]
    assert waits and waits[-1]["outer_step"] == 1 and waits[-1]["timed_out"] is False


def test_a_global_later_than_its_merge_step_is_reported_with_the_fix(caplog):
    """A global that arrives a second after its merge step: the node waits there, then says
    in one line that the exchange takes longer than ``overlap_steps`` and what hides it."""
    node, rec, model = started_node(sync="overlapped", inner=2, overlap=1, timeout=5.0)

    def publish_late(job):
        threading.Timer(1.2, offer, args=(node, job.round + 1, 50.0)).start()

    rec.on_send = publish_late
    for _ in range(3):
        train(model, 1.0)
        with caplog.at_level(logging.INFO, logger="speedtronic.diloco"):
            node.after_optimizer_step()
    assert node.rounds.installed == 1 and weights(model) == [51.0, 51.0]
    notes = [r.getMessage() for r in caplog.records if "after its merge step" in r.getMessage()]
    assert len(notes) == 1 and "raise overlap_steps" in notes[0], notes


def test_the_schedule_survives_a_checkpoint():
    """A node resumed between its upload and the merge's step merges at that step too."""
    node, _, model = started_node(sync="overlapped", inner=4, overlap=3)
    for _ in range(5):
        train(model, 1.0)
        node.after_optimizer_step()
    state = node.state_dict()
    assert state["merges"] == [[7, 1]]
    other, _, other_model = make_node(sync="overlapped", inner=4, overlap=3)
    other.load_state_dict(state)
    with torch.no_grad():
        other_model.weight.copy_(model.weight)
    offer(other, 1, 100.0)
    train(other_model, 1.0)
    assert other.after_optimizer_step() is False  # step 6 < 7
    train(other_model, 1.0)
    assert other.after_optimizer_step() is True  # step 7
    assert weights(other_model) == [103.0, 103.0]


def test_fragments_send_one_part_per_round_and_a_round_of_each_part_at_the_end():
    """``fragments: 2``: rounds of ``inner_steps / 2`` steps, each syncing one fragment (its
    progress since its own last sync, with its carry); the run ends with the schedule's next
    rounds, one of each fragment (its progress since its own round), the last one final."""
    node, rec, model = fragmented_node(overlap=None)
    publish, installed = master_for_state(node), []

    def send(job):  # what the node held when it sent each round, then the round's global
        installed.append(node.rounds.installed)
        publish(job)

    rec.on_send = send
    for _ in range(4):  # rounds 0 and 1, two steps each
        add_all(model, 1.0)
        node.after_optimizer_step()
    keys = [sorted(job.delta) for job in rec.sent]
    assert keys == [list(node.fragments[0]), list(node.fragments[1])]
    assert set(keys[0]).isdisjoint(keys[1]) and set(keys[0]) | set(keys[1]) == set(
        model.state_dict()
    )
    # round 0's fragment: 2 steps; round 1's: 4 steps (since the start)
    assert all(v.flatten().tolist() == [-2.0] * v.numel() for v in rec.sent[0].delta.values())
    assert all(v.flatten().tolist() == [-4.0] * v.numel() for v in rec.sent[1].delta.values())
    add_all(model, 1.0)  # a step that is no round's: the run ends inside round 2
    node.after_optimizer_step()
    node.finish()
    ending = rec.sent[2:]  # fragment 0: 3 steps since round 0; fragment 1: 1 step since round 1
    assert [(j.round, j.final, sorted(j.delta)) for j in ending] == [
        (2, False, sorted(node.fragments[0])),
        (3, True, sorted(node.fragments[1])),
    ]
    for job, want in zip(ending, (-3.0, -1.0), strict=True):
        assert all(v.flatten().tolist() == [want] * v.numel() for v in job.delta.values())
    # no global is merged between the ending rounds (round 2's landed at once): the last
    # round is taken from the weights the first was, whatever the exchange's timing
    assert installed == [0, 1, 2, 2] and node.rounds.installed == 4


def test_a_run_that_ends_on_a_fragments_round_leaves_that_fragment_out_of_the_final():
    """The final contribution of a run that ends on a round boundary holds every tensor but
    the fragment that round just synced (nothing trained since): 1/N of its bytes fewer."""
    node, rec, model = fragmented_node(overlap=None)
    rec.on_send = master_for_state(node)
    for _ in range(4):  # rounds 0 and 1: the run ends on round 1's step
        add_all(model, 1.0)
        node.after_optimizer_step()
    node.finish()
    last = rec.sent[-1]
    assert last.final and sorted(last.delta) == sorted(node.fragments[0]), sorted(last.delta)
    for key, value in last.delta.items():  # fragment 0: 2 steps since round 0
        assert value.flatten().tolist() == [-2.0] * value.numel(), key
    held = model.state_dict()  # the final global, from both fragments' last rounds
    assert all(v.flatten().tolist() == [4.0] * v.numel() for v in held.values())


def test_an_overlapped_final_contribution_does_not_wait_for_the_globals_in_flight():
    """The rounds that end the run carry each tensor's progress since its last contribution,
    so a round still in flight at the end is not waited for: its global, late here, never
    holds the final uploads up, nor do the ending rounds wait for each other's globals, and
    the final global replaces everything the node holds."""
    node, rec, model = fragmented_node(sync="overlapped", overlap=3, timeout=5.0)
    publish = master_for_state(node)
    rec.on_send = lambda job: None if job.round == 1 else publish(job)  # round 1: in flight
    for _ in range(5):  # round 0 at step 2 (merged at 5), round 1 at step 4 (its global late)
        add_all(model, 1.0)
        node.after_optimizer_step()
    started = time.monotonic()
    node.finish()
    assert time.monotonic() - started < 2.0  # not the 5 s a wait for global 2 would take
    # step 5 is no round's step: a round of each fragment ends the run, the last one final
    assert [(j.round, j.final) for j in rec.sent] == [(0, False), (1, False), (2, False), (3, True)]
    for job, part, want in zip(rec.sent[2:], node.fragments, (-3.0, -1.0), strict=True):
        assert sorted(job.delta) == sorted(part)  # fragment 0: 3 steps since round 0; 1: 1
        assert all(v.flatten().tolist() == [want] * v.numel() for v in job.delta.values())
    assert not node.rounds.merges and node.rounds.installed == 4


def test_fragments_keep_two_rounds_in_flight_and_merge_each_fragment_at_its_step():
    """``fragments: 2`` (rounds of 2 steps) with ``overlap_steps`` 3: round 1 is sent before
    round 0's global is merged; at step 5 only fragment 0's tensors take the global, at
    step 7 fragment 1's (from the newest global, whose fragment-0 values are unchanged)."""
    node, rec, model = fragmented_node(sync="overlapped", overlap=3, timeout=2.0)
    rec.on_send = master_for_state(node)
    first, second = node.fragments

    def value(key):
        return model.state_dict()[key].flatten()[0].item()

    for step in range(1, 8):
        add_all(model, 1.0)
        node.after_optimizer_step()
        if step == 4:  # round 1 sent, global 1 (round 0) not merged yet: two in flight
            assert [j.round for j in rec.sent] == [0, 1] and node.rounds.installed == 0
        if step == 5:  # fragment 0 only, from the newest global (2: round 1 was sent at 4)
            assert value(first[0]) == 5.0 and value(second[0]) == 5.0
        if step == 6:
            assert value(second[0]) == 6.0
    # step 7: fragment 1 takes the newest global (3, published at round 2's upload, step 6;
    # its fragment-1 values are round 1's) + the 3 steps since its upload
    assert value(second[0]) == 7.0 and node.rounds.installed == 3
    assert node.rounds.merges == [MergeDue(9, 3)]  # fragment 0's round 2, at step 9
    pulled = [p["outer_step"] for n, p in rec.events if n == "global_pulled"]
    assert pulled == [0, 2, 3]  # each global reported once, at its first merge


def test_overlapped_boundary_waits_for_the_previous_global_then_runs_ahead():
    node, rec, model = started_node(sync="overlapped", timeout=0.05)
    for _ in range(4):  # two boundaries, no master answering
        train(model, 1.0)
        node.after_optimizer_step()
    # the second boundary waited (bounded) for global 1, then contributed to round 1 on base 0
    assert [(j.round, j.base) for j in rec.sent] == [(0, 0), (1, 0)]
    waits = [p for n, p in rec.events if n == "sync_wait"]
    assert waits and waits[0]["outer_step"] == 1 and waits[0]["timed_out"]
    offer(node, 1, 50.0)  # global 1 arrives late: labels keep increasing
    for _ in range(2):
        train(model, 1.0)
        node.after_optimizer_step()
    assert node.rounds.installed == 1 and rec.sent[-1].round == 2


def test_a_newer_global_is_held_until_the_node_contributed():
    node, rec, model = make_node(timeout=0.05)
    offer(node, 3, 0.0)
    node.merge_waiting()
    train(model, 1.0)
    offer(node, 4, 7.0)  # the master closed round 3 without us (timeout)
    assert node.after_optimizer_step() is False
    assert weights(model) == [1.0, 1.0]  # our progress is not dropped
    assert node.rounds.installed == 3
    train(model, 1.0)
    node.after_optimizer_step()
    job = rec.sent[0]
    assert (job.round, job.base) == (3, 3)  # late: the master folds it in if within staleness
    assert job.delta["weight"].tolist() == [[-2.0, -2.0]]
    assert node.rounds.installed == 4 and weights(model) == [7.0, 7.0]
    train(model, 1.0)
    node.after_optimizer_step()
    train(model, 1.0)
    node.after_optimizer_step()
    assert rec.sent[-1].round == 4


def test_failed_upload_is_carried_into_the_next_contribution():
    node, rec, model = started_node(timeout=0.05)
    rec.fail_next = 1
    for _ in range(2):
        train(model, 1.0)
        node.after_optimizer_step()
    assert not rec.sent and "delta_upload_failed" in rec.names()
    assert "sync_wait" not in rec.names()  # nothing to wait for: the master never saw it
    for _ in range(2):
        train(model, 1.0)
        node.after_optimizer_step()
    job = rec.sent[0]  # the same round: a failed upload does not use up its label
    assert job.round == 0 and job.delta["weight"].tolist() == [[-4.0, -4.0]]


def test_zero_contribution_is_not_uploaded():
    node, rec, _model = make_node()
    offer(node, 0, 0.0)
    node.merge_waiting()
    node.after_optimizer_step()
    node.after_optimizer_step()
    assert not rec.sent and "delta_upload_zero" in rec.names()


class FakeTime:
    """The node's clock (``time.monotonic``/``perf_counter`` in its module), moved by the test."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now

    perf_counter = monotonic


def test_each_contribution_reports_the_seconds_its_round_trained_and_waited(monkeypatch):
    """``round_done`` at each contribution: ``compute_seconds`` in inner steps since the last
    one, ``wait_seconds`` at the boundary on the exchange (here the upload and the master's
    answer), ``utilization`` = compute / both; a boundary with nothing to send ends no round:
    the next one counts its steps from the last contribution."""
    clock = FakeTime()
    monkeypatch.setattr(node_module, "time", clock)
    node, rec, model = started_node()
    node.clock.restart()  # training starts (the coordinator's start)

    def slow_master(job):  # the upload and the round take 2 s, then global r+1 is there
        clock.now += 2.0
        offer(node, job.round + 1, 0.0)

    rec.on_send = slow_master
    for amount in (1.0, 1.0, 0.0, 0.0, 1.0, 1.0):  # rounds 0, (nothing), 1
        clock.now += 1.5  # one inner step
        train(model, amount)
        node.after_optimizer_step()
    done = [fields for name, fields in rec.events if name == "round_done"]
    assert [(row["round"], row["step"], row["final"]) for row in done] == [
        (0, 2, False),
        (1, 6, False),
    ]
    assert done[0]["compute_seconds"] == pytest.approx(3.0)
    assert done[0]["wait_seconds"] == pytest.approx(2.0)
    assert done[0]["utilization"] == pytest.approx(0.6)
    # round 1: four steps (two of them before the empty boundary) and the 2 s exchange
    assert done[1]["compute_seconds"] == pytest.approx(6.0)
    assert done[1]["wait_seconds"] == pytest.approx(2.0)
    assert done[1]["utilization"] == pytest.approx(0.75)
    assert "delta_upload_zero" in rec.names()


def test_finish_uploads_the_final_contribution_and_installs_its_global():
    node, rec, model = started_node(inner=4)
    rec.on_send = master_for(node, lambda job: 42.0)
    train(model, 1.0)
    node.after_optimizer_step()
    node.finish()
    job = rec.sent[-1]
    assert job.final and job.round == 0 and job.delta["weight"].tolist() == [[-1.0, -1.0]]
    assert node.end.done and node.rounds.installed == 1 and weights(model) == [42.0, 42.0]


def test_a_failed_final_upload_is_sent_again_not_lost():
    node, rec, model = started_node(inner=4)
    rec.on_send = master_for(node, lambda job: 7.0)
    rec.fail_next = 2  # the first two attempts fail; the third arrives
    train(model, 1.0)
    node.after_optimizer_step()
    node.finish()
    [job] = rec.sent
    assert job.final and job.round == 0 and job.delta["weight"].tolist() == [[-1.0, -1.0]]
    assert rec.names().count("delta_upload_failed") == 2
    assert node.end.done and node.progress.carry is None and weights(model) == [7.0, 7.0]


def test_a_failed_upload_of_a_round_that_ends_the_run_is_sent_again_under_its_round():
    """With fragments the run ends with a round of each fragment: one whose upload fails is
    sent again (carried, under the same round, with the same fragment) before the next one,
    so no fragment's progress is lost or sent under another's round."""
    node, rec, model = fragmented_node(sync="overlapped", overlap=3, timeout=5.0, threaded=True)
    rec.on_send = master_for_state(node)
    for _ in range(5):  # rounds 0 and 1 at steps 2 and 4; step 5 is no round's
        add_all(model, 1.0)
        node.after_optimizer_step()
    rec.fail_next, rec.fail_after = 1, 0.3  # the first ending round's first attempt fails
    node.finish()
    ending = rec.sent[2:]
    assert [(j.round, j.final, sorted(j.delta)) for j in ending] == [
        (2, False, sorted(node.fragments[0])),
        (3, True, sorted(node.fragments[1])),
    ]
    for job, want in zip(ending, (-3.0, -1.0), strict=True):  # the 3 and the 1 steps, once
        assert all(v.flatten().tolist() == [want] * v.numel() for v in job.delta.values())
    assert rec.names().count("delta_upload_failed") == 1
    assert node.end.done and node.progress.carry is None
    held = model.state_dict()  # the final global: every step of both fragments
    assert all(v.flatten().tolist() == [5.0] * v.numel() for v in held.values())


def test_a_failed_done_status_is_reported_as_such_and_sent_again(caplog):
    # the last step ends a round: its contribution arrived, only the done status is left
    node, rec, model = started_node(inner=1)
    rec.on_send = master_for(node, lambda job: 5.0)
    train(model, 1.0)
    node.after_optimizer_step()
    assert [job.round for job in rec.sent] == [0] and node.rounds.installed == 1
    rec.fail_next = 2  # the first two done statuses fail; the third arrives
    node.finish()
    status = rec.sent[1:]
    assert len(status) == 1 and status[0].delta is None and status[0].final
    # nothing was carried, and no delta upload failed: the status did, twice
    assert rec.names().count("status_upload_failed") == 2
    assert "delta_upload_failed" not in rec.names()
    assert node.progress.carry is None and node.end.done
    assert not any("carried" in r.getMessage() for r in caplog.records)


def test_a_final_upload_that_never_arrives_is_kept_and_reported(caplog):
    node, rec, model = started_node(inner=4)
    rec.fail_next = 100
    train(model, 1.0)
    node.after_optimizer_step()
    node.finish()
    assert not rec.sent and rec.names().count("delta_upload_failed") == 3
    # checkpointed, re-sent on resume
    assert node.progress.carry["weight"].tolist() == [[-1.0, -1.0]]
    assert any("final contribution could not be uploaded" in r.getMessage()
               for r in caplog.records if r.levelname == "ERROR")  # fmt: skip


def test_a_final_contribution_left_in_the_checkpoint_is_sent_on_resume():
    """A final upload that failed every attempt leaves the node not done: its checkpoint holds
    the carry, and the resumed node's finish() sends it (before, ``done`` was saved and the
    resumed finish() returned at once: the last round never reached the master)."""
    node, rec, model = started_node(inner=4)
    rec.fail_next = 100
    train(model, 1.0)
    node.after_optimizer_step()
    node.finish()
    assert not rec.sent and not node.end.done
    state = node.state_dict()
    assert state["done"] is False and state["carry"] is not None
    resumed, rec2, model2 = make_node(inner=4)
    assert resumed.load_state_dict(state) is None
    with torch.no_grad():
        model2.weight.copy_(model.weight)
    rec2.on_send = master_for(resumed, lambda job: 3.0)
    resumed.finish()
    [job] = rec2.sent
    assert job.final and job.delta["weight"].tolist() == [[-1.0, -1.0]]
    assert resumed.end.done and resumed.progress.carry is None and weights(model2) == [3.0, 3.0]


def test_finish_with_nothing_left_sends_only_the_done_status():
    node, rec, model = started_node(inner=1)
    rec.on_send = master_for(node, lambda job: 5.0)
    train(model, 1.0)
    node.after_optimizer_step()  # boundary: round 0, global 1 installed
    node.finish()
    assert rec.sent[-1].delta is None and rec.sent[-1].round == 0  # done after round 0
    assert node.end.done


def test_state_round_trip_resends_the_upload_in_flight():
    node, rec, model = make_node(sync="overlapped")
    node.uploads.threaded = True
    gate = threading.Event()
    rec.on_send = lambda job: gate.wait(5)
    offer(node, 0, 0.0)
    node.merge_waiting()
    for _ in range(2):
        train(model, 1.0)
        node.after_optimizer_step()
    state = node.state_dict()
    assert state["pending"]["round"] == 0 and state["inner"] == 0
    gate.set()
    node.stop()
    fresh, _rec2, _model2 = make_node(sync="overlapped")
    pending = fresh.load_state_dict(state)
    assert pending is not None and pending.round == 0
    assert pending.delta["weight"].tolist() == [[-2.0, -2.0]]
    # the upload had not arrived: its label is not used up until it is sent again; "none
    # yet" is -1 in the checkpoint (as every release wrote it) and None in the node
    assert state["last_round"] == state["last_label"] == -1
    assert (fresh.rounds.installed, fresh.rounds.last_round, fresh.step) == (0, None, 2)


def test_the_node_state_keeps_the_key_older_readers_of_its_format_read():
    """``speedtronic-diloco-node/2`` was first written with ``last_label``; a reader of that
    key (an older release resuming this checkpoint) finds it beside ``last_round``."""
    node, rec, model = started_node(inner=1)
    rec.on_send = master_for(node, lambda job: 1.0)
    train(model, 1.0)
    node.after_optimizer_step()
    state = node.state_dict()
    assert state["format"] == "speedtronic-diloco-node/2"
    assert state["last_round"] == state["last_label"] == 0
    old = {k: v for k, v in state.items() if k != "last_round"}  # as older releases wrote it
    again, _, _ = make_node(inner=1)
    again.load_state_dict(old)
    assert again.rounds.last_round == 0


def test_reset_inner_optimizer_only_when_asked():
    for reset, expect_empty in ((False, False), (True, True)):
        node, _rec, model = make_node(reset=reset)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        node.optimizer = opt
        offer(node, 0, 1.0)
        node.merge_waiting()
        assert (len(opt.state) == 0) is expect_empty


def test_merge_handles_tied_weights():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(2, 2, bias=False)
            self.b = torch.nn.Linear(2, 2, bias=False)
            self.b.weight = self.a.weight

    model = Tied()
    node, _rec, _ = make_node(sync="overlapped", model=model)
    node.rounds.installed, node.rounds.last_round = 0, 0
    with torch.no_grad():
        model.a.weight.fill_(1.0)
    node.progress.anchor = {k: torch.zeros(2, 2) for k in ("a.weight", "b.weight")}
    node.merge(
        GlobalCandidate(
            1, {"a.weight": torch.full((2, 2), 5.0), "b.weight": torch.full((2, 2), 5.0)}
        )
    )
    assert model.a.weight.tolist() == [[6.0, 6.0], [6.0, 6.0]]  # G + progress, not G + G - anchor


def test_hook_counts_applied_optimizer_steps():
    node, rec, model = make_node(inner=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    node.attach(opt)
    offer(node, 0, 0.0)
    node.merge_waiting()
    rec.on_send = master_for(node, lambda job: 0.0)
    for _ in range(3):
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert node.step == 3 and [j.round for j in rec.sent] == [0]
    node.detach()
    opt.step()
    assert node.step == 3


def test_a_new_run_is_installed_as_it_is_and_restarts_the_round_count():
    node, rec, model = make_node(timeout=5.0)
    node.inbox.offer(GlobalCandidate(15, {"weight": torch.full((1, 2), 9.0)}, run_id="old"))
    node.merge_waiting()
    assert (node.rounds.installed, node.rounds.run_id) == (15, "old")
    # while the node waits for global 16 of the old run, a master starts a new run
    rec.on_send = lambda job: node.inbox.offer(
        GlobalCandidate(0, {"weight": torch.full((1, 2), 1.0)}, run_id="new")
    )
    train(model, 1.0)
    node.after_optimizer_step()
    train(model, 1.0)
    node.after_optimizer_step()
    assert rec.sent[0].round == 15 and rec.sent[0].run_id == "old"
    waits = [p for n, p in rec.events if n == "sync_wait"]
    assert waits[-1]["seconds"] < 2.0  # no waiting for a round of the old run
    assert (node.rounds.installed, node.rounds.run_id, node.rounds.last_round) == (0, "new", None)
    assert weights(model) == [1.0, 1.0]  # the new run's global exactly, no old progress
    rec.on_send = None
    train(model, 0.5)
    node.after_optimizer_step()
    train(model, 0.5)
    node.after_optimizer_step()
    assert (rec.sent[-1].round, rec.sent[-1].run_id) == (0, "new")
    assert rec.sent[-1].delta["weight"].tolist() == [[-1.0, -1.0]]


def _momentum_node():
    """A node with ``sync_inner_momentum: every_round`` and an AdamW that took one step."""
    settings = DistributedConfig(
        inner_steps=1,
        round_timeout=0.2,
        async_delta_upload=False,
        sync_inner_momentum="every_round",
    )
    model = torch.nn.Linear(2, 1, bias=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    rec = Recorder()
    node = DiLoCoNode(
        RoundSettings.of(settings),
        model,
        send=rec.send,
        inbox=GlobalInbox(None, interval=0.01, threaded=False),
        emit=rec.emit,
    )
    node.bind(optimizer)
    offer(node, 0, 0.0)
    node.merge_waiting()
    return node, rec, model, optimizer


def _with_moments(step, round, value):
    candidate = GlobalCandidate(step, {"weight": torch.zeros(1, 2)})
    candidate.moments = round, {"weight": torch.full((1, 2), float(value))}
    return candidate


def test_a_node_sends_its_first_moment_and_installs_the_mean_of_its_round():
    node, rec, model, optimizer = _momentum_node()
    own = optimizer.state[model.weight]["exp_avg"].clone()
    rec.on_send = lambda job: node.inbox.offer(_with_moments(job.round + 1, job.round, 7.0))
    train(model, 1.0)
    node.after_optimizer_step()  # round 0: delta + first moment, then global 1 with the mean
    job = rec.sent[0]
    assert sorted(job.delta) == ["moment::weight", "weight"]
    assert torch.equal(job.delta["moment::weight"], own)
    assert optimizer.state[model.weight]["exp_avg"].tolist() == [[7.0, 7.0]]


def test_a_node_keeps_its_own_first_moment_for_a_round_it_did_not_send_to():
    node, rec, model, optimizer = _momentum_node()
    own = optimizer.state[model.weight]["exp_avg"].clone()
    rec.on_send = lambda job: node.inbox.offer(_with_moments(job.round + 1, job.round + 5, 7.0))
    train(model, 1.0)
    node.after_optimizer_step()
    assert node.rounds.installed == 1 and "moment::weight" in rec.sent[0].delta
    assert torch.equal(optimizer.state[model.weight]["exp_avg"], own)
