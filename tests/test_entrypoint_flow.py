"""run_command's control flow in-process, with a stand-in runtime (no training): readiness,
heartbeat, signals, node-id collisions, port in use, and the JSON log shape."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
from types import SimpleNamespace

import pytest
import torch
import yaml
from test_deploy_support import REPO
from test_rehearsal_support import free_port, http_get

from speedtronic import entrypoint
from speedtronic.config import resolve_config
from speedtronic.diloco.link import NodeIdCollisionError
from speedtronic.metrics.server import MetricsPortInUse
from speedtronic.train.parallel import SingleProcess


def resolved(tmp_path, **env):
    environ = {"SPEEDTRONIC_METRICS__HOST": "127.0.0.1", **env}
    environ.setdefault("SPEEDTRONIC_METRICS__PORT", str(free_port()))
    return resolve_config(
        str(REPO / "configs/smoke.yaml"), environ=environ, secrets_dir=str(tmp_path / "none")
    )


class FakeCoordinator:
    node_id = "node-7"
    role = "worker"

    def __init__(self, ready=True):
        self.ready = ready

    def is_ready(self):
        return self.ready


class FakeTrainer:
    """Records what run_command does to it; `fit` runs a scripted body."""

    def __init__(self, body=None, coordinator=None):
        self.logger = SimpleNamespace(hooks=[], closed=False)
        self.logger.close = lambda: setattr(self.logger, "closed", True)
        self.coordinator = coordinator
        self.stop_reason = None
        self.fitted = False
        self.last_heartbeat = None
        self.parallel = SingleProcess()  # one process, as the Trainer's default
        self.model = torch.nn.Linear(2, 2)  # what the start-up lines read from a Trainer
        self.device = torch.device("cpu")
        self.precision = SimpleNamespace(mode="fp32")
        self.body = body or (lambda trainer: None)

    def request_stop(self, reason):
        self.stop_reason = reason

    def emit(self, event, payload):
        for hook in self.logger.hooks:
            (getattr(hook, "on_event", None) or hook)(event, payload)

    def fit(self):
        self.fitted = True
        self.body(self)
        return SimpleNamespace(steps=3, stopped_reason=self.stop_reason)


def use(monkeypatch, trainer):
    calls = []

    def build(config, resume):
        calls.append(resume)
        return trainer, None

    monkeypatch.setattr(entrypoint, "_build", build)
    return calls


def test_clean_run_wires_the_sink_and_returns_0(tmp_path, monkeypatch):
    seen = {}

    def body(trainer):
        trainer.emit("train_start", {"start_step": 0})
        trainer.emit("train_step", {"step": 1, "loss": 1.0, "lr": 0.1, "tokens": 8, "samples": 1})
        port = trainer.port
        seen["ready"] = http_get(f"http://127.0.0.1:{port}/readyz")[0]
        seen["metrics"] = http_get(f"http://127.0.0.1:{port}/metrics")[1]

    trainer = FakeTrainer(body, FakeCoordinator())
    cfg = resolved(tmp_path)
    trainer.port = cfg.config.metrics.port
    calls = use(monkeypatch, trainer)
    assert entrypoint.run_command(cfg, resume=True) == 0
    assert calls == [True] and trainer.fitted
    assert seen["ready"] == 200
    assert 'speedtronic_train_steps_total{node_id="node-7",role="worker"} 1.0' in seen["metrics"]
    assert any(getattr(h, "wants_all_steps", False) for h in trainer.logger.hooks)
    # The server is gone and the signal handlers are restored afterwards.
    assert http_get(f"http://127.0.0.1:{trainer.port}/metrics")[0] == 0
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_worker_is_not_ready_until_the_coordinator_is(tmp_path):
    state = entrypoint._RunState()
    assert not state.ready()
    state.trainer = FakeTrainer(coordinator=FakeCoordinator(ready=False))
    state.built = True
    assert not state.ready()
    state.trainer.coordinator.ready = True
    assert state.ready()
    state.trainer.coordinator = None  # single node: model built is enough
    assert state.ready()


def test_heartbeat_is_the_latest_of_phase_trainer_and_steps():
    state = entrypoint._RunState(last_phase=10.0)
    assert state.heartbeat() == 10.0
    state.trainer = SimpleNamespace(last_heartbeat=25.0)
    state.sink = SimpleNamespace(last_step_time=20.0)
    assert state.heartbeat() == 25.0


def test_sigterm_requests_a_stop_and_the_run_exits_0(tmp_path, monkeypatch):
    def body(trainer):
        os.kill(os.getpid(), signal.SIGTERM)

    trainer = FakeTrainer(body)
    use(monkeypatch, trainer)
    assert entrypoint.run_command(resolved(tmp_path)) == 0
    assert trainer.stop_reason == "SIGTERM"


def test_second_signal_gives_up_with_keyboard_interrupt(tmp_path, monkeypatch):
    def body(trainer):
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)

    use(monkeypatch, FakeTrainer(body))
    with pytest.raises(KeyboardInterrupt):
        entrypoint.run_command(resolved(tmp_path))


def test_failed_graceful_stop_returns_128_plus_signal(tmp_path, monkeypatch):
    def body(trainer):
        os.kill(os.getpid(), signal.SIGTERM)
        raise RuntimeError("final checkpoint failed")

    use(monkeypatch, FakeTrainer(body))
    assert entrypoint.run_command(resolved(tmp_path)) == 128 + signal.SIGTERM


def test_runtime_failure_propagates(tmp_path, monkeypatch):
    def body(trainer):
        raise RuntimeError("boom")

    use(monkeypatch, FakeTrainer(body))
    with pytest.raises(RuntimeError, match="boom"):
        entrypoint.run_command(resolved(tmp_path))


@pytest.mark.parametrize("command", ["run", "train"])
def test_collision_raised_by_the_coordinator_propagates(tmp_path, monkeypatch, command):
    """The coordinator raises the collision where it finds it (its startup claim); the runner
    neither listens for events nor turns the error into a stop, under both commands."""

    def body(trainer):
        raise NodeIdCollisionError("w-1")

    trainer = FakeTrainer(body)
    use(monkeypatch, trainer)
    with pytest.raises(entrypoint.NodeIdCollisionError, match=r"distributed\.node_id.*'w-1'"):
        entrypoint.launch(resolved(tmp_path), command=command)
    assert trainer.stop_reason is None and trainer.logger.closed
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_config_error_while_stopping_stays_a_config_error(tmp_path, monkeypatch):
    def body(trainer):
        os.kill(os.getpid(), signal.SIGTERM)
        raise NodeIdCollisionError("w-1")

    use(monkeypatch, FakeTrainer(body))
    with pytest.raises(NodeIdCollisionError):
        entrypoint.run_command(resolved(tmp_path))


def test_collision_after_training_started_only_logs(tmp_path, monkeypatch):
    def body(trainer):
        trainer.emit("train_start", {"start_step": 0})
        trainer.emit("node_id_collision", {"node_id": "w-1"})

    trainer = FakeTrainer(body)
    use(monkeypatch, trainer)
    assert entrypoint.run_command(resolved(tmp_path)) == 0
    assert trainer.stop_reason is None


def test_port_in_use_fails_before_the_runtime_is_built(tmp_path, monkeypatch):
    calls = use(monkeypatch, FakeTrainer())
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with pytest.raises(MetricsPortInUse, match=r"metrics\.port"):
            entrypoint.run_command(resolved(tmp_path, SPEEDTRONIC_METRICS__PORT=str(port)))
    assert calls == []


def test_metrics_disabled_starts_no_server(tmp_path, monkeypatch):
    trainer = FakeTrainer()
    use(monkeypatch, trainer)
    cfg = resolved(tmp_path, SPEEDTRONIC_METRICS__ENABLED="false")
    assert entrypoint.run_command(cfg) == 0
    assert trainer.fitted


def test_json_formatter_matches_the_metric_logger_shape():
    formatter = entrypoint.JsonLogFormatter()
    plain = logging.LogRecord(
        "speedtronic.entrypoint", logging.INFO, __file__, 1, "hi %s", ("x",), None
    )
    line = json.loads(formatter.format(plain))
    assert line["message"] == "hi x" and line["ts"].endswith("Z") and line["level"] == "INFO"
    event = logging.LogRecord("speedtronic.entrypoint", logging.INFO, __file__, 1, "s", (), None)
    event.st_event, event.st_fields = "startup", {"a": 1}
    line = json.loads(formatter.format(event))
    assert line["event"] == "startup" and line["fields"] == {"a": 1}


@pytest.mark.parametrize(
    ("command", "enabled", "serves"),
    [("run", None, True), ("train", None, False), ("train", "true", True), ("run", "false", False)],
)
def test_one_runner_metrics_server_is_optional(tmp_path, monkeypatch, command, enabled, serves):
    seen = {}

    def body(trainer):
        seen["status"] = http_get(f"http://127.0.0.1:{trainer.port}/healthz")[0]

    env = {} if enabled is None else {"SPEEDTRONIC_METRICS__ENABLED": enabled}
    cfg = resolved(tmp_path, **env)
    trainer = FakeTrainer(body)
    trainer.port = cfg.config.metrics.port
    use(monkeypatch, trainer)
    outcome = entrypoint.launch(cfg, command=command)
    assert outcome.exit_code == 0 and outcome.result.steps == 3
    assert (seen["status"] == 200) is serves


def test_one_json_formatter():
    from speedtronic.metrics.logger import JsonLogFormatter

    assert entrypoint.JsonLogFormatter is JsonLogFormatter


@pytest.mark.parametrize("command", ["run", "train"])
def test_the_config_is_logged_once(tmp_path, capsys, command):
    cfg = resolved(
        tmp_path,
        SPEEDTRONIC_METRICS__ENABLED="false",
        SPEEDTRONIC_RUN__OUTPUT_DIR=str(tmp_path / "out"),
    )
    cfg.config.apply_run_target(2)
    outcome = entrypoint.launch(cfg, command=command)
    assert outcome.exit_code == 0 and outcome.result.steps == 2
    out = capsys.readouterr().out
    # issue 21: a short summary on stdout; the full resolved config goes to a file
    assert not [line for line in out.splitlines() if '"n_layer"' in line or len(line) > 600]
    config_lines = [line for line in out.splitlines() if "config: " in line]
    assert len(config_lines) == 1, config_lines
    written = tmp_path / "out" / entrypoint.RESOLVED_CONFIG_FILE
    assert str(written) in config_lines[0] and "resolved, redacted" in config_lines[0]
    record = yaml.safe_load(written.read_text())
    assert record["config"]["run"]["output_dir"] == str(tmp_path / "out")
    assert record["sources"]["run.output_dir"] == "env:SPEEDTRONIC_RUN__OUTPUT_DIR"
    summary = [line for line in out.splitlines() if "runtime built" in line]
    assert len(summary) == 1 and " parameters (" in summary[0] and "exchange none" in summary[0]
    assert sum(f"speedtronic {command} starting" in line for line in out.splitlines()) == 1


def test_json_event_records_keep_their_message_in_the_process_log():
    """Process events (``SIGTERM received ...``) keep the text; MetricLogger events, whose
    text restates the fields, do not."""
    from speedtronic.metrics.logger import JsonLogFormatter

    record = logging.LogRecord(
        "speedtronic.entrypoint", logging.INFO, __file__, 1, "SIGTERM received", (), None
    )
    record.st_event, record.st_fields = "stop_requested", {"signal": "SIGTERM"}
    line = json.loads(entrypoint.JsonLogFormatter().format(record))
    assert line["message"] == "SIGTERM received" and line["event"] == "stop_requested"
    quiet = json.loads(JsonLogFormatter("speedtronic", event_messages=False).format(record))
    assert "message" not in quiet and quiet["logger"] == "speedtronic"
