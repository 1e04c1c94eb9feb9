"""The coordinator with a hand-driven training loop: identity and claims, a pure aggregator
with a worker in one process (through the end of the run), secrets, and a startup outage."""

from __future__ import annotations

import json
import logging
import threading
import time

import pytest
import torch
from hub_emulator_fixtures import TEST_TOKEN, fast_retry, hub_emulator, make_transport  # noqa: F401
from test_diloco_master import lines

from speedtronic.config import ConfigError, DistributedConfig
from speedtronic.diloco.coordinator import DumbDiLoCoCoordinator
from speedtronic.diloco.directory import DirectoryTransport
from speedtronic.diloco.link import NodeIdCollisionError, resolve_node_id


class Log:
    """The coordinator's metrics logger: its ``emit(event, payload)`` (lines go to the
    ``speedtronic.diloco`` logger, read with :func:`lines`)."""

    def __init__(self):
        self.events = []
        self.lock = threading.Lock()

    def emit(self, event, payload):
        with self.lock:
            self.events.append((event, dict(payload)))

    def names(self):
        with self.lock:
            return [e for e, _ in self.events]


class BlockingTransport(DirectoryTransport):
    """Directory transport whose uploads wait for ``release`` (and may fail)."""

    def __init__(self, root):
        super().__init__(f"file://{root}", fast_retry())
        self.started, self.release, self.uploaded = (threading.Event() for _ in range(3))
        self.fail = False
        self.uploads = []

    def upload_delta(self, delta, **kw):
        self.uploads.append((kw["round_index"], {k: v.clone() for k, v in delta.items()}))
        self.started.set()
        assert self.release.wait(5)
        if self.fail:
            raise RuntimeError("upload failed")
        out = super().upload_delta(delta, **kw)
        self.uploaded.set()
        return out


def cfg(repo, **kw):
    base = dict(
        enabled=True,
        repo_id=f"file://{repo}",
        role="worker",
        node_id="w1",
        inner_steps=1,
        poll_interval=0.01,
        round_timeout=0.2,
        retry_initial=0.01,
        retry_max=0.05,
        retry_attempts=2,
        delta_upload_shutdown_timeout=2.0,
    )
    base.update(kw)
    return DistributedConfig(**base)


def nudge(model, amount=0.1):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(amount)


def make(tmp_path, transport=None, **kw):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    log = Log()
    c = DumbDiLoCoCoordinator(
        cfg(tmp_path / "repo", **kw),
        model,
        hub=transport,
        state_dir=tmp_path / "state",
        logger=log,
        environ={},
    )
    return c, model, log


def test_node_id_fallback_chain_and_path_safety():
    assert resolve_node_id(None, {"HOSTNAME": "pod-1", "USER": "bob"}) == "pod-1"
    assert resolve_node_id(None, {"SPEEDTRONIC_NODE_ID": "n9", "HOSTNAME": "pod"}) == "n9"
    assert resolve_node_id(None, {"HF_USERNAME": "hf", "USER": "bob"}) == "hf"
    assert resolve_node_id(None, {"USER": "bob"}) == "bob"
    assert resolve_node_id(None, {}) == "local"
    assert resolve_node_id("explicit", {"HOSTNAME": "pod"}) == "explicit"
    for bad in ("a/b", "..", "x y", "a\\b"):
        with pytest.raises(ConfigError, match=r"distributed\.node_id"):
            resolve_node_id(None, {"HOSTNAME": bad})


def test_node_id_collision_is_reported(tmp_path, caplog):
    hub_a = BlockingTransport(tmp_path / "repo")
    hub_a.release.set()
    a, model_a, log_a = make(
        tmp_path, hub_a, sync="overlapped", async_delta_upload=False, async_global_poll=False
    )
    a.start()
    hub_b = BlockingTransport(tmp_path / "repo")
    hub_b.release.set()
    b, model_b, log_b = make(
        tmp_path / "other",
        hub_b,
        sync="overlapped",
        async_delta_upload=False,
        async_global_poll=False,
    )
    b.start()  # same node id, another instance: takes over the (possibly dead) claim
    assert "node_id_collision" not in log_b.names()
    nudge(model_a)
    a.after_optimizer_step(model_a, 1)  # a finds b's claim: b is alive
    assert ("node_id_collision", {"node_id": "w1"}) in log_a.events
    said = [m for lvl, m in lines(caplog) if lvl == "error" and "collision" in m]
    assert any(b.claim.instance in m for m in said)  # a reported b's instance
    nudge(model_b)
    b.after_optimizer_step(model_b, 1)  # and b finds a's claim (written with a's upload)
    assert ("node_id_collision", {"node_id": "w1"}) in log_b.events
    a.stop()
    b.stop()


def _on_host(tmp_path, host, **kw):
    """Worker ``w`` on ``host`` (its own state), on the exchange shared under ``tmp_path``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    settings = cfg(tmp_path / "repo", async_global_poll=False, async_delta_upload=False, **kw)
    c = DumbDiLoCoCoordinator(
        settings, model, state_dir=tmp_path / host, logger=Log(), environ={"HOSTNAME": host}
    )
    return c, model


def test_another_hosts_holder_is_watched_for_drop_after_rounds(tmp_path):
    """A live node writes once a round: the later host watches its files for drop_after x
    round_timeout (not one round_timeout) and exits 2 when it writes within that time."""
    # nodes without a liveness beat (a holder that beats is watched for liveness_timeout)
    first, model_a = _on_host(tmp_path, "host-a", round_timeout=0.05, liveness_timeout=0)
    first.start()
    second, _ = _on_host(  # a 0.9 s watch
        tmp_path, "host-b", round_timeout=0.3, drop_after=3, liveness_timeout=0
    )

    def the_first_writes_late():
        time.sleep(0.6)  # after one round_timeout, within drop_after of them
        nudge(model_a)
        first.after_optimizer_step(model_a, 1)

    writer = threading.Thread(target=the_first_writes_late, daemon=True)
    writer.start()
    try:
        with pytest.raises(NodeIdCollisionError, match="into the watch"):
            second.start()
    finally:
        writer.join()
    first.stop()


def test_a_node_that_took_an_id_over_stops_before_its_first_upload_if_the_holder_wrote(
    tmp_path, caplog
):
    """The holder was silent through the watch, then uploaded just before the later node's
    claim landed (so the record names the later node): the later node stops before its first
    upload, which could otherwise take the holder's round's place; the holder logs an error."""
    caplog.set_level(logging.INFO, logger="speedtronic.diloco")
    # nodes without a liveness beat (a beating holder would be seen live by the watch)
    first, model_a = _on_host(tmp_path, "host-a", round_timeout=0.05, liveness_timeout=0)
    first.start()
    second, model_b = _on_host(
        tmp_path, "host-b", round_timeout=0.05, drop_after=1, liveness_timeout=0
    )
    second.start()  # the holder wrote nothing in its watch: the id is taken over
    assert "taking node id 'w1' over" in caplog.text
    nudge(model_a)
    first.after_optimizer_step(model_a, 1)  # the holder is live: its round 0 is uploaded
    assert "was taken over by instance" in caplog.text
    # the later node's claim landed after that upload: the record names it again
    second.store.claim_owner("w1", second.claim.record(state="training"))
    nudge(model_b)
    with pytest.raises(NodeIdCollisionError, match="after this node's watch ended"):
        second.after_optimizer_step(model_b, 1)
        second.after_optimizer_step(model_b, 2)  # an async or late report: the next step
    files = sorted(p for p in first.store.scan().files if p.startswith("nodes/w1/"))
    assert files == ["nodes/w1/delta_0.safetensors", "nodes/w1/owner.json"]  # only the holder's
    first.stop()
    second.stop()


def test_a_beating_holder_is_watched_for_the_liveness_timeout_not_rounds(tmp_path, caplog):
    """Issue 40: a holder that beats is seen live within a beat, and a dead one is taken
    over after liveness_timeout (1 s here), not drop_after x round_timeout (10 s). Each
    start first waits round_timeout (2 s) for a global that no master publishes here."""
    caplog.set_level(logging.INFO, logger="speedtronic.diloco")
    first, _ = _on_host(tmp_path, "host-a", heartbeat_interval=0.1, liveness_timeout=1.0)
    first.start()
    slow = dict(round_timeout=2.0, drop_after=5, heartbeat_interval=0.1, liveness_timeout=1.0)
    live, _ = _on_host(tmp_path, "host-b", **slow)
    started = time.monotonic()
    with pytest.raises(NodeIdCollisionError, match="into the watch"):
        live.start()  # the holder's beats change its files
    assert time.monotonic() - started < 2.0 + 2
    first._beats.stop()  # the holder dies (its beats stop; its record stays)
    taker, _ = _on_host(tmp_path, "host-c", **slow)
    started = time.monotonic()
    taker.start()
    assert 2.0 + 1.0 <= time.monotonic() - started < 2.0 + 4
    assert "taking node id 'w1' over" in caplog.text
    taker.stop()


def test_restart_takes_over_its_own_dead_claim(tmp_path):
    first, _model, _log = make(tmp_path, async_global_poll=False)
    first.start()
    first.stop()
    (tmp_path / "state/w1/identity.json").unlink()  # a restart that lost its state dir
    second, model2, log2 = make(tmp_path, async_global_poll=False)
    assert second.claim.instance != first.claim.instance
    second.start()
    nudge(model2)
    second.after_optimizer_step(model2, 1)
    second.stop()
    assert "node_id_collision" not in log2.names()


def test_pure_aggregator_and_a_worker_in_one_process_through_the_end(tmp_path):
    repo = f"file://{tmp_path}/repo"
    master, m_model, m_log = make(
        tmp_path / "m",
        role="master",
        node_id="m",
        repo_id=repo,
        outer_lr=1.0,
        outer_momentum=0.0,
        train=False,
        round_timeout=5.0,
    )
    master.final_dir = tmp_path / "final"
    worker, w_model, _w_log = make(
        tmp_path / "w", role="worker", node_id="w", repo_id=repo, round_timeout=5.0
    )
    assert not master.trains and master.node is None
    master.start()
    assert master.is_ready() and master.outer_step == 0
    worker.start()
    assert worker.is_ready() and worker.last_global_step == 0
    before = w_model.weight.detach().clone()
    nudge(w_model, -0.5)
    assert worker.after_optimizer_step(w_model, 1) is True  # upload, then global 1 merged
    assert worker.last_global_step == 1
    assert torch.allclose(w_model.weight, before - 0.5)  # one node, plain averaging
    deadline = time.monotonic() + 10  # the worker may read global 1 before the event is out
    while "outer_step" not in m_log.names() and time.monotonic() < deadline:
        time.sleep(0.01)
    rounds = [p for e, p in m_log.events if e == "outer_step"]
    assert [r["included"] for r in rounds] == [["w/0"]]
    nudge(w_model, -0.25)
    worker.after_optimizer_step(w_model, 2)
    worker.finish()  # nothing left since the last upload: only the done status
    master.finish()  # returns once every node is done and the final global is out
    assert master.master.finished.is_set()
    assert (tmp_path / "final" / "model.safetensors").exists()
    meta = json.loads((tmp_path / "final" / "meta.json").read_text())
    assert meta["outer_step"] == 2 and meta["ledger"] == {"w": 1} and meta["step"] == 2
    assert torch.allclose(m_model.weight, w_model.weight)  # the aggregator holds the final global
    worker.stop()
    master.stop()


def test_a_restarted_pure_aggregator_keeps_its_finished_run(tmp_path):
    """A pure aggregator's step is always 0: a restart (from its checkpoint, or with only its
    own outer state in state_dir) is not a new run, and the finished run's final global stays
    on the exchange (before, every restart started a new run over it)."""
    repo = f"file://{tmp_path}/repo"

    def aggregator(where):
        return make(
            tmp_path / where, role="master", node_id="m", repo_id=repo, train=False,
            round_timeout=5.0,
        )  # fmt: skip

    master, _, _ = aggregator("m")
    worker, w_model, _ = make(
        tmp_path / "w", role="worker", node_id="w", repo_id=repo, round_timeout=5.0
    )
    master.start(0)
    worker.start()
    nudge(w_model, -0.5)
    assert worker.after_optimizer_step(w_model, 1) is True
    worker.finish()
    master.finish()
    final = master.store.global_metadata()
    assert final.final
    checkpoint = master.state_dict()
    worker.stop()
    master.stop()
    # restarted from its checkpoint, on a machine that lost its state_dir
    again, _, _ = aggregator("elsewhere")
    again.load_state_dict(checkpoint)
    again.start(0)
    again.stop()
    meta = again.store.global_metadata()
    assert meta.final and (meta.outer_step, meta.run_id) == (final.outer_step, final.run_id)
    # restarted without a checkpoint (killed before it wrote one): its own outer state tells
    third, _, _ = aggregator("m")
    assert third.master.agreement.has_local_state
    third.start(0)
    third.stop()
    meta = third.store.global_metadata()
    assert meta.final and (meta.outer_step, meta.run_id) == (final.outer_step, final.run_id)


def test_token_never_in_state_or_events(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="speedtronic.diloco")
    token = "hf_SUPERsecret_token_value"
    hub = BlockingTransport(tmp_path / "repo")
    hub.release.set()
    hub.fail = True
    c, model, log = make(
        tmp_path, hub, token=token, async_delta_upload=False, async_global_poll=False
    )
    c.start()
    nudge(model)
    c.after_optimizer_step(model, 1)
    c.stop()
    blob = repr(c.state_dict()) + repr(log.events) + repr(lines(caplog))
    assert token not in blob and "delta_upload_failed" in log.names()


def test_outage_at_startup_does_not_hold_training(tmp_path):
    class Down(DirectoryTransport):
        calls = 0

        def _read(self, path, max_bytes=None):
            Down.calls += 1
            raise ConnectionError("hub unreachable")

        def _commit(self, additions, deletions, message):
            raise ConnectionError("hub unreachable")

    sleeps: list[float] = []
    down = Down(f"file://{tmp_path}/repo", fast_retry(attempts=6, sleeps=sleeps))
    c, model, log = make(tmp_path, down, async_global_poll=False, async_delta_upload=False)
    started = time.monotonic()
    c.start()
    assert time.monotonic() - started < 5  # bounded by round_timeout, two attempts per call
    assert not c.is_ready()
    assert down.retry.attempts == 6  # the full policy is back for later calls
    nudge(model)
    assert c.after_optimizer_step(model, 1) is False  # upload failed, carried, training goes on
    assert "delta_upload_failed" in log.names()
    assert any("retry" in e for e in log.names())
    assert c.node.progress.carry is not None
    c.stop()


def _master(tmp_path, **kw):
    return make(tmp_path, role="master", node_id="m", train=False, **kw)


def test_finish_is_bounded_when_the_master_rounds_stall(tmp_path, monkeypatch):
    """A master that waits for a node that never delivers, and whose rounds never close, ends
    its wait after the bound with an error saying what it waited for and how long."""
    import speedtronic.diloco.coordinator as coordinator_module

    monkeypatch.setattr(coordinator_module, "STALL_MARGIN_S", 0.0)
    c, _, _ = _master(tmp_path, round_timeout=0.2, drop_after=1)
    c.start(0)
    c.master.stop()  # its rounds stall: nothing ever closes
    started = time.monotonic()
    with pytest.raises(coordinator_module.RoundsStalledError, match=r"waited \d+ s .*final"):
        c.finish()
    assert time.monotonic() - started < 10
    c.stop()


def test_finish_waits_on_while_the_master_sees_progress(tmp_path, monkeypatch):
    """The bound counts from the last progress the master saw, not from the last global: a
    pure aggregator enters finish() at once, and its first round may take longer than the bound
    (slow steps, workers started late). While contributions or status changes keep coming it is
    not killed; once they stop, it still gives up after the bound."""
    import speedtronic.diloco.coordinator as coordinator_module

    monkeypatch.setattr(coordinator_module, "STALL_MARGIN_S", 0.0)
    c, _, _ = _master(tmp_path, round_timeout=0.2, drop_after=1)  # bound: 0.6 s
    c.start(0)
    c.master.stop()  # no round closes: only the signs of progress below
    halt = threading.Event()

    def a_node_keeps_updating():
        until = time.monotonic() + 2.0
        while time.monotonic() < until and not halt.is_set():
            c.master.watch.last_progress = time.monotonic()
            time.sleep(0.05)

    busy = threading.Thread(target=a_node_keeps_updating, daemon=True)
    started = time.monotonic()
    busy.start()
    try:
        with pytest.raises(coordinator_module.RoundsStalledError, match=r"no progress"):
            c.finish()
    finally:
        halt.set()
        busy.join()
    assert time.monotonic() - started >= 2.0  # not killed while the node showed progress
    c.stop()


def test_a_fatal_master_error_is_raised_on_the_training_thread_and_in_finish(tmp_path):
    from speedtronic.diloco.exchange import ExchangeError

    c, model, _ = make(tmp_path, role="master", node_id="m", async_global_poll=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    c.attach(optimizer)
    c.start(0)
    c.master.stop()
    c.master.fatal = ExchangeError("global/latest.safetensors: corrupt, and no local state")
    model(torch.ones(1, 2)).sum().backward()
    with pytest.raises(ExchangeError, match="corrupt"):
        optimizer.step()
    with pytest.raises(ExchangeError, match="corrupt"):
        c.finish()
    c.stop()


def test_an_exchange_error_from_the_master_reconcile_is_not_a_warning(tmp_path, monkeypatch):
    from speedtronic.diloco.exchange import ExchangeError

    c, _, _ = _master(tmp_path)

    def unusable(**_):
        raise ExchangeError("global/latest.safetensors is corrupt and there is no local state")

    monkeypatch.setattr(c.master, "reconcile", unusable)
    with pytest.raises(ExchangeError, match="corrupt"):
        c.start(0)
    c.stop()


def test_a_master_whose_startup_could_not_create_the_repository_creates_it_later(
    tmp_path,
    hub_emulator,  # noqa: F811
):
    """An outage during the master's startup (two quick attempts) must not leave the exchange
    uncreated for the whole run: its thread creates it at its next poll and bootstraps the
    global (before, nobody ever created it, and every node's upload was refused)."""
    from speedtronic.diloco.hub import HubClient
    from speedtronic.retry import TransportError

    class Flaky(HubClient):
        failures = 2

        def create_repo(self, *, private=True):
            if Flaky.failures:
                Flaky.failures -= 1
                raise TransportError("HTTP 503 from POST /api/repos/create")
            super().create_repo(private=private)

    store = Flaky(
        "org/late",
        token=TEST_TOKEN,
        endpoint=hub_emulator.url,
        cache_dir=tmp_path / "cache",
        retry=fast_retry(),
        missing_repo_wait=30.0,  # as build_transport sets it (round_timeout)
    )
    c, _, _ = make(
        tmp_path,
        store,
        role="master",
        node_id="m",
        train=False,
        repo_id="org/late",
        token=TEST_TOKEN,
    )

    def published():
        try:
            return hub_emulator.files("org/late")
        except KeyError:  # no such repository yet
            return {}

    c.start(0)
    try:
        deadline = time.monotonic() + 30
        while "global/step_count.json" not in published():
            assert time.monotonic() < deadline, "the master never created its exchange"
            time.sleep(0.05)
    finally:
        c.stop()
    assert Flaky.failures == 0


@pytest.mark.parametrize("feedback", [True, False])
def test_the_error_feedback_switch_reaches_the_node(tmp_path, feedback):
    c, _, _ = make(tmp_path, delta_dtype="int8", error_feedback=feedback)
    assert c.node.settings.wire.error_feedback is feedback


def test_a_nodes_first_round_counts_from_the_start_of_its_training(tmp_path):
    """The time before training (building, the wait for the first global) is in no round:
    the first ``round_done`` counts compute from the end of ``start()``."""
    repo = f"file://{tmp_path}/repo"
    master, _, _ = make(
        tmp_path / "m", role="master", node_id="m", repo_id=repo, train=False, round_timeout=5.0
    )
    worker, w_model, w_log = make(
        tmp_path / "w", role="worker", node_id="w", repo_id=repo, round_timeout=5.0
    )
    master.start()
    time.sleep(0.6)  # the worker's node exists; its training has not started
    worker.start()
    nudge(w_model, -0.5)
    assert worker.after_optimizer_step(w_model, 1) is True  # upload, then global 1 merged
    (done,) = [p for e, p in w_log.events if e == "round_done"]
    assert done["round"] == 0 and done["step"] == 1 and done["final"] is False
    assert done["compute_seconds"] < 0.6 and done["wait_seconds"] > 0, done
    worker.stop()
    master.stop()


# -- issue 40: leaving and liveness -------------------------------------------------------
def test_a_leaving_worker_costs_the_round_in_progress_nothing(tmp_path):
    """A worker stopped before its run ended (SIGTERM) records that it left; the round the
    master held for it closes at once, so the other worker's wait for its global (bounded by
    a round_timeout of 60 s) ends in about a poll."""
    repo = f"file://{tmp_path}/repo"
    common = dict(repo_id=repo, round_timeout=60.0, outer_lr=1.0, outer_momentum=0.0)
    master, _, m_log = make(tmp_path / "m", role="master", node_id="m", train=False, **common)
    w, w_model, _ = make(tmp_path / "w", node_id="w", **common)
    v, _, _ = make(tmp_path / "v", node_id="v", **common)
    master.start()
    w.start()
    v.start()
    nudge(w_model, -0.5)
    waiting = threading.Thread(target=w.after_optimizer_step, args=(w_model, 1), daemon=True)
    started = time.monotonic()
    waiting.start()  # uploads round 0, then waits for global 1 (v is expected)
    time.sleep(0.5)
    assert waiting.is_alive() and master.outer_step == 0
    v.stop()  # before its run ended: it leaves
    waiting.join(10)
    assert not waiting.is_alive() and w.last_global_step == 1
    assert time.monotonic() - started < 10  # not round_timeout
    assert v.store.read_owner("v")["state"] == "left"
    assert [p["node_id"] for e, p in m_log.events if e == "node_left"] == ["v"]
    deadline = time.monotonic() + 10  # w may read global 1 before the event is out
    while "outer_step" not in m_log.names() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [p["reason"] for e, p in m_log.events if e == "outer_step"] == ["complete"]
    w.stop()
    master.stop()


@pytest.mark.parametrize("resumable", [True, False])
def test_a_worker_beats_while_it_runs_and_says_whether_it_may_resume(tmp_path, resumable):
    torch.manual_seed(0)
    c = DumbDiLoCoCoordinator(
        cfg(tmp_path / "repo", heartbeat_interval=0.1, liveness_timeout=1.0),
        torch.nn.Linear(2, 2),
        state_dir=tmp_path / "state",
        logger=Log(),
        environ={},
        resumable=resumable,
    )
    c.start()
    beat = tmp_path / "repo/nodes/w1/beat.json"
    seen = set()
    deadline = time.monotonic() + 5
    while len(seen) < 3 and time.monotonic() < deadline:
        if beat.exists():
            seen.add(json.loads(beat.read_text())["beat"])
        time.sleep(0.01)
    assert len(seen) >= 3, seen  # a counter that changes every beat
    c.stop()
    last = beat.read_text()
    time.sleep(0.2)
    assert beat.read_text() == last  # no beat after the stop
    owner = c.store.read_owner("w1")
    assert owner["state"] == "left" and owner["resume"] is resumable


def test_a_worker_that_finished_or_a_master_never_says_it_left(tmp_path):
    worker, _, _ = make(tmp_path / "w", async_global_poll=False)
    worker.start()
    worker.finish()  # nothing to contribute: only the done status
    worker.stop()
    assert worker.store.read_owner("w1")["state"] == "done"
    master, _, _ = make(tmp_path / "m", role="master", node_id="m")
    master.start()
    master.stop()
    assert master.store.read_owner("m")["state"] == "training"
    assert not (tmp_path / "m/repo/nodes/m/beat.json").exists()  # the master does not beat


def test_on_the_hub_a_node_beats_once_a_round_and_only_when_waited_for(
    tmp_path,
    make_transport,  # noqa: F811 (the fixture)
):
    """A Hub beat is a commit: a node sends one only when another node's contribution to
    the round it owes was listed at two looks in a row (a heartbeat_interval apart), once
    per round; nodes that finish together send none."""
    hub = make_transport("hub")
    hub.create_repo()
    c, _, _ = make(tmp_path, transport=hub, repo_id="org/run")
    link, commits = c.link, hub.commits
    link.beat_if_waited(0)
    link.beat_if_waited(0)
    assert hub.commits == commits  # nobody delivered: nobody waits for it
    other = {"instance": "x-1", "run_id": "", "final": "false"}
    hub.upload_delta(
        {"w": torch.ones(2)}, node_id="x", round_index=0, local_step=1, base_outer_step=0,
        metadata=other,
    )  # fmt: skip
    commits = hub.commits
    link.beat_if_waited(0)  # first look that sees it: maybe the two finish together
    assert hub.commits == commits
    link.beat_if_waited(0)  # still waited for a whole interval later: one beat
    link.beat_if_waited(0)
    assert hub.commits == commits + 1
    assert json.loads(hub.read_bytes("nodes/w1/beat.json"))["beat"] == 1
    assert c.settings.rules.heartbeat_interval == 30.0  # the Hub's defaults
    assert c.settings.rules.liveness_timeout == 120.0
