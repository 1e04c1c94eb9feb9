"""Coordinator behaviour with a fake training loop: async lanes, sync mode, restarts, identity."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hub_emulator_fixtures import fast_retry

from speedtronic.config import ConfigError, DistributedConfig
from speedtronic.diloco.coordinator import DumbDiLoCoCoordinator
from speedtronic.diloco.directory import DirectoryTransport
from speedtronic.diloco.identity import resolve_node_id


class Log:
    def __init__(self):
        self.events, self.lines = [], []
        self.lock = threading.Lock()

    def emit(self, event, payload):
        with self.lock:
            self.events.append((event, dict(payload)))

    def names(self):
        with self.lock:
            return [e for e, _ in self.events]

    def _line(self, level, msg, *a):
        with self.lock:
            self.lines.append((level, msg % a if a else msg))

    def info(self, msg, *a):
        self._line("info", msg, *a)

    def warning(self, msg, *a):
        self._line("warning", msg, *a)

    def error(self, msg, *a):
        self._line("error", msg, *a)


class BlockingTransport(DirectoryTransport):
    """Directory transport whose uploads wait for ``release`` (and may fail)."""

    def __init__(self, root):
        super().__init__(f"file://{root}", fast_retry())
        self.started, self.release, self.uploaded = (threading.Event() for _ in range(3))
        self.fail = False
        self.uploads = []

    def upload_delta(self, delta, **kw):
        self.uploads.append((kw["local_step"], {k: v.clone() for k, v in delta.items()}))
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


def test_async_upload_returns_at_once_and_busy_boundary_is_skipped(tmp_path):
    hub = BlockingTransport(tmp_path / "repo")
    c, model, log = make(tmp_path, hub, async_global_poll=False)
    c.start()
    nudge(model)
    t0 = time.monotonic()
    assert c.after_optimizer_step(model, 1) is True
    assert time.monotonic() - t0 < 0.5
    assert hub.started.wait(1)
    nudge(model)
    t0 = time.monotonic()
    assert c.after_optimizer_step(model, 2) is False
    assert time.monotonic() - t0 < 0.5
    assert ("delta_upload_skipped", {"step": 2, "reason": "upload_in_flight"}) in log.events
    assert c.state_dict()["pending_upload"]["step"] == 1
    hub.release.set()
    assert hub.uploaded.wait(2)
    c.stop()
    assert "delta_uploaded" in log.names()
    assert hub.delta_paths() == ["nodes/w1/delta_1.safetensors"]


def test_pending_job_survives_state_dict_and_restart(tmp_path):
    first_hub = BlockingTransport(tmp_path / "repo")
    first, model, _ = make(tmp_path, first_hub, async_global_poll=False)
    first.start()
    nudge(model)
    assert first.after_optimizer_step(model, 1)
    assert first_hub.started.wait(1)
    state = first.state_dict()
    assert state["pending_upload"]["step"] == 1
    # "crash": the first process never finishes its upload
    second_hub = BlockingTransport(tmp_path / "repo")
    second_hub.release.set()
    second, model2, _ = make(tmp_path / "b", second_hub, async_global_poll=False)
    second.model = model2
    second.prepare_state(state)
    second.start()
    assert second_hub.uploaded.wait(2)
    assert second_hub.uploads[0][0] == 1
    assert torch.equal(
        second_hub.uploads[0][1]["weight"], state["pending_upload"]["delta"]["weight"]
    )
    second.stop()
    first_hub.release.set()
    first.stop()


def test_load_state_dict_after_start_requeues_pending(tmp_path):
    first_hub = BlockingTransport(tmp_path / "repo")
    first, model, _ = make(tmp_path, first_hub, async_global_poll=False)
    first.start()
    nudge(model)
    first.after_optimizer_step(model, 1)
    assert first_hub.started.wait(1)
    state = first.state_dict()
    hub2 = BlockingTransport(tmp_path / "repo")
    hub2.release.set()
    second, _model2, _ = make(tmp_path / "b", hub2, async_global_poll=False)
    second.start()
    second.load_state_dict(state)
    assert hub2.uploaded.wait(2)
    second.stop()
    first_hub.release.set()
    first.stop()


def test_synchronous_mode(tmp_path):
    hub = BlockingTransport(tmp_path / "repo")
    hub.release.set()
    c, model, _log = make(tmp_path, hub, async_delta_upload=False, async_global_poll=False)
    c.start()
    assert c._upload_thread is None and c._poll_thread is None
    nudge(model)
    assert c.after_optimizer_step(model, 1) is True
    assert hub.uploaded.is_set() and c.state_dict()["last_uploaded_step"] == 1
    c.stop()


def test_failed_upload_is_carried_into_the_next_delta(tmp_path):
    hub = BlockingTransport(tmp_path / "repo")
    hub.release.set()
    hub.fail = True
    c, model, log = make(tmp_path, hub, async_delta_upload=False, async_global_poll=False)
    c.start()
    baseline = {k: v.clone() for k, v in c._baseline.items()}
    nudge(model, 0.1)
    assert c.after_optimizer_step(model, 1) is False
    assert "delta_upload_failed" in log.names()
    hub.fail = False
    nudge(model, 0.2)
    assert c.after_optimizer_step(model, 2) is True
    step, delta = hub.uploads[-1]
    assert step == 2
    expected = baseline["weight"] - model.weight.detach()
    assert torch.allclose(delta["weight"], expected, atol=1e-6)  # cumulative: 0.1 + 0.2
    c.stop()


def test_zero_delta_is_not_uploaded(tmp_path):
    hub = BlockingTransport(tmp_path / "repo")
    hub.release.set()
    c, model, log = make(tmp_path, hub, async_global_poll=False)
    c.start()
    assert c.after_optimizer_step(model, 1) is False
    assert ("delta_upload_zero", {"step": 1}) in log.events
    assert hub.uploads == []
    c.stop()


def test_worker_installs_global_on_training_thread_at_boundary(tmp_path):
    repo = DirectoryTransport(f"file://{tmp_path}/repo", fast_retry())
    c, model, log = make(tmp_path, inner_steps=2)
    c.start()
    assert not c.is_ready()
    repo.publish_global({"weight": torch.full((2, 2), 9.0), "bias": torch.zeros(2)}, outer_step=1)
    deadline = time.monotonic() + 3
    step = 0
    while c.last_global_step != 1 and time.monotonic() < deadline:
        step += 1
        nudge(model, 0.01)
        c.after_optimizer_step(model, step)
        time.sleep(0.01)
    assert c.last_global_step == 1 and c.is_ready()
    assert torch.equal(model.weight.detach(), torch.full((2, 2), 9.0))
    assert any(e == "global_pulled" and p["outer_step"] == 1 for e, p in log.events)
    c.stop()
    c.start()  # restart after stop
    assert c._poll_thread is not None
    nudge(model)
    c.after_optimizer_step(model, step + 1)
    c.stop()


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


def test_node_id_collision_is_reported(tmp_path):
    hub_a = BlockingTransport(tmp_path / "repo")
    hub_a.release.set()
    a, model_a, log_a = make(tmp_path, hub_a, async_delta_upload=False, async_global_poll=False)
    a.start()
    hub_b = BlockingTransport(tmp_path / "repo")
    hub_b.release.set()
    b, model_b, log_b = make(
        tmp_path / "other", hub_b, async_delta_upload=False, async_global_poll=False
    )
    b.start()  # same node id, another instance: takes over the (possibly dead) claim
    assert "node_id_collision" not in log_b.names()
    nudge(model_a)
    a.after_optimizer_step(model_a, 1)  # a finds b's claim: b is alive
    assert ("node_id_collision", {"node_id": "w1"}) in log_a.events
    assert any(lvl == "error" and "collision" in m for lvl, m in log_a.lines)
    nudge(model_b)
    b.after_optimizer_step(model_b, 1)  # and b finds a's claim (written with a's upload)
    assert ("node_id_collision", {"node_id": "w1"}) in log_b.events
    a.stop()
    b.stop()


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


def test_master_and_worker_in_one_process(tmp_path):
    master, m_model, m_log = make(
        tmp_path / "m", role="master", node_id="m", repo_id=f"file://{tmp_path}/repo", outer_lr=1.0
    )
    worker, w_model, _w_log = make(
        tmp_path / "w", role="worker", node_id="w", repo_id=f"file://{tmp_path}/repo"
    )
    master.start()
    assert master.is_ready() and master.last_global_step == 0
    worker.start()
    assert worker.is_ready() and worker.last_global_step == 0
    nudge(w_model, -0.5)
    assert worker.after_optimizer_step(w_model, 1)
    deadline = time.monotonic() + 5
    step = 1
    while master.last_global_step < 1 and time.monotonic() < deadline:
        step += 1
        master.after_optimizer_step(m_model, step)
        time.sleep(0.02)
    assert master.last_global_step >= 1
    assert any(e == "outer_step" and p["deltas_included"] >= 1 for e, p in m_log.events)
    state = master.state_dict()
    assert state["outer"]["processed_deltas"]
    worker.stop()
    master.stop()


def test_token_never_in_state_or_events(tmp_path):
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
    blob = repr(c.state_dict()) + repr(log.events) + repr(log.lines)
    assert token not in blob


def test_outage_at_startup_does_not_hold_training(tmp_path):
    class Down(DirectoryTransport):
        calls = 0

        def _read(self, path):
            Down.calls += 1
            raise ConnectionError("hub unreachable")

        def _commit(self, additions, deletions, message):
            raise ConnectionError("hub unreachable")

    sleeps: list[float] = []
    down = Down(f"file://{tmp_path}/repo", fast_retry(attempts=6, sleeps=sleeps))
    c, model, log = make(tmp_path, down, async_global_poll=False, async_delta_upload=False)
    c.start()
    assert Down.calls <= 4 and len(sleeps) <= 3  # two attempts per startup call
    assert not c.is_ready()
    assert down.retry.attempts == 6  # the full policy is back for later calls
    nudge(model)
    assert c.after_optimizer_step(model, 1) is False  # upload failed, carried, training goes on
    assert "delta_upload_failed" in log.names()
    assert any("retry" in e for e in log.names())
    c.stop()
