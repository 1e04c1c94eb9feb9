"""`speedtronic run` end to end in real subprocesses (`python -m speedtronic run --config ...`).

/metrics is parsed with prometheus_client's text parser; every documented series must exist and
the training ones must move between two scrapes. SIGTERM must stop the run at a step boundary
with a final checkpoint and exit 0. Bad inputs exit 2 with one clear line before any training.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from pathlib import Path

import pytest
import yaml
from process_support import run_speedtronic
from test_deploy_support import REPO
from test_rehearsal_support import (
    Rehearsal,
    free_port,
    http_get,
    metric,
    scrape,
    scrape_value,
    wait_until,
)

from speedtronic.metrics.prometheus import SERIES

pytestmark = pytest.mark.slow

# Series that must change between two scrapes of a single-node run that is training.
MOVING = [
    "speedtronic_train_steps_total",
    "speedtronic_train_tokens_total",
    "speedtronic_train_samples_total",
    "speedtronic_train_step",
    "speedtronic_train_step_seconds_count",
    "speedtronic_train_learning_rate",
    "speedtronic_checkpoint_saves_total",
    "speedtronic_checkpoint_save_seconds_count",
]


def tiny_config(tmp_path: Path, **overrides) -> Path:
    """configs/smoke.yaml made endless (stopped by SIGTERM) with frequent checkpoints."""
    config = yaml.safe_load((REPO / "configs/smoke.yaml").read_text())
    config["max_steps"] = 100_000
    config["checkpoint"] = {"enabled": True, "every_steps": 2, "keep_last": 2}
    config["logging"] = {"level": "INFO", "every_steps": 1000}
    config["scheduler"] = {"name": "cosine", "warmup_steps": 1}
    for key, value in overrides.items():
        config[key] = value
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("SPEEDTRONIC_") and key not in ("HF_TOKEN", "HF_USERNAME")
    }
    env.update(
        {
            "SPEEDTRONIC_SECRETS_DIR": str(tmp_path / "no-secrets"),
            "OMP_NUM_THREADS": "1",
            "CUDA_VISIBLE_DEVICES": "",
            "PYTHONPATH": str(REPO),
        }
    )
    env.update(extra)
    return env


def start(tmp_path: Path, name: str, config: Path, port: int, **extra: str) -> Rehearsal:
    workdir = tmp_path / name
    workdir.mkdir(exist_ok=True)
    env = run_env(tmp_path, SPEEDTRONIC_METRICS__PORT=str(port), **extra)
    argv = [sys.executable, "-m", "speedtronic", "run", "--config", str(config)]
    return Rehearsal(name, argv, env, str(workdir), port).start(tmp_path)


def latest_checkpoint_step(output_dir: Path) -> int:
    pointers = list(output_dir.rglob("latest.json"))
    assert pointers, f"no checkpoint under {output_dir}"
    data = json.loads(pointers[0].read_text())
    step = data.get("step")
    if step is None:
        step = int("".join(ch for ch in str(data.get("path", data)) if ch.isdigit()) or -1)
    return int(step)


def test_run_serves_metrics_and_stops_cleanly_on_sigterm(tmp_path):
    port = free_port()
    proc = start(tmp_path, "single", tiny_config(tmp_path), port)
    try:
        wait_until(lambda: http_get(proc.url("/readyz"))[0] == 200, 180, "/readyz", [proc])
        status, body = http_get(proc.url("/healthz"))
        assert status == 200 and json.loads(body)["healthy"] is True
        first = wait_until(
            lambda: (s := scrape(port)) and metric(s, "speedtronic_train_steps_total") >= 1 and s,
            180,
            "a first step",
            [proc],
        )

        def moved():
            now = scrape(port)
            done = all(metric(now, name) != metric(first, name) for name in MOVING)
            return now if done else None

        second = wait_until(moved, 180, "every training series to move", [proc])
        names = {name for name, _ in second}
        for series in SERIES:
            if series == "speedtronic_diloco_retries_total":
                continue  # one series per operation, created by the first retry
            if series == "speedtronic_diloco_node_last_seen_seconds":
                continue  # one series per node of a master's run (no DiLoCo here)
            assert series in names or f"{series}_count" in names, series
        for (_name, labels), _ in second.items():
            assert dict(labels)["role"] == "single" and dict(labels)["node_id"]
        assert http_get(proc.url("/healthz"))[0] == 200
        code = proc.terminate(timeout=120)
        output = proc.output()
        assert code == 0, output[-3000:]
        assert "SIGTERM received" in output
        steps = metric(second, "speedtronic_train_step")
        saved = latest_checkpoint_step(tmp_path / "single")
        assert saved >= steps
        # A restarted container (SPEEDTRONIC_CHECKPOINT__RESUME=true in the manifests) continues
        # from that final checkpoint; the restored total does not inflate this process's counters.
        proc = start(
            tmp_path,
            "single",
            tiny_config(tmp_path),
            free_port(),
            SPEEDTRONIC_CHECKPOINT__RESUME="true",
        )
        wait_until(
            lambda: (scrape_value(proc.port, "speedtronic_train_steps_total") or 0) >= 1,
            180,
            "the restarted run to train",
            [proc],
        )
        again = scrape(proc.port)
        resumed_step = metric(again, "speedtronic_train_step")
        assert resumed_step > saved
        assert metric(again, "speedtronic_train_steps_total") <= resumed_step - saved + 1
        assert proc.terminate(timeout=120) == 0
    finally:
        proc.kill()


def test_json_logs_are_one_object_per_line_and_never_carry_the_token(tmp_path):
    config = tiny_config(tmp_path, max_steps=2)
    env = run_env(
        tmp_path,
        SPEEDTRONIC_LOGGING__FORMAT="json",
        SPEEDTRONIC_METRICS__ENABLED="false",
        HF_TOKEN="hf_SuperSecretValue123",
    )
    result = run_speedtronic("run", "--config", str(config), env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "hf_SuperSecretValue123" not in result.stdout + result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    assert all({"ts", "level", "logger"} <= set(r) for r in records)
    startup = next(r for r in records if r.get("event") == "startup")["fields"]
    assert startup["versions"]["speedtronic"] and startup["versions"]["torch"]
    assert "python" in startup["versions"] and "cuda" in startup["versions"]
    assert startup["config"]["distributed"]["token"] == "<redacted>"
    assert startup["sources"]["distributed.token"].startswith("env:")
    assert startup["sources"]["logging.format"] == "env:SPEEDTRONIC_LOGGING__FORMAT"
    assert any(r.get("event") == "run_finished" for r in records)


def _bad_input_cases(tmp_path: Path, busy_port: int) -> dict[str, tuple[list[str], dict, str]]:
    config = tiny_config(tmp_path)
    not_a_dir = tmp_path / "secrets-file"
    not_a_dir.write_text("x")
    return {
        "missing config file": (["--config", str(tmp_path / "nope.yaml")], {}, "nope.yaml"),
        "unreadable secrets dir": (
            ["--config", str(config)],
            {"SPEEDTRONIC_SECRETS_DIR": str(not_a_dir)},
            "secrets",
        ),
        "port in use": (
            ["--config", str(config)],
            {"SPEEDTRONIC_METRICS__PORT": str(busy_port), "SPEEDTRONIC_METRICS__HOST": "127.0.0.1"},
            "metrics.port",
        ),
        "unknown variable": (
            ["--config", str(config)],
            {"SPEEDTRONIC_FOO": "1"},
            "SPEEDTRONIC_FOO",
        ),
    }


@pytest.mark.parametrize(
    "case", ["missing config file", "unreadable secrets dir", "port in use", "unknown variable"]
)
def test_bad_input_exits_2_with_one_line_before_training(tmp_path, case):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        args, extra, needle = _bad_input_cases(tmp_path, busy.getsockname()[1])[case]
        env = run_env(tmp_path, SPEEDTRONIC_METRICS__PORT=str(free_port()))
        env.update(extra)
        result = run_speedtronic("run", *args, env=env, cwd=tmp_path)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert needle in lines[0]
    assert "Traceback" not in result.stderr + result.stdout
    assert not list(tmp_path.rglob("*.pt")), "training started"


def test_worker_node_id_collision_exits_2_before_training(tmp_path):
    exchange = tmp_path / "exchange"
    common = {
        "SPEEDTRONIC_DISTRIBUTED__ENABLED": "true",
        "SPEEDTRONIC_DISTRIBUTED__ROLE": "worker",
        "SPEEDTRONIC_DISTRIBUTED__REPO_ID": exchange.as_uri(),
        "SPEEDTRONIC_DISTRIBUTED__POLL_INTERVAL": "0.5",
        # no master: the first worker trains once its wait for a first global (round_timeout)
        # ends; 5 s, not the default 120
        "SPEEDTRONIC_DISTRIBUTED__ROUND_TIMEOUT": "5",
        "SPEEDTRONIC_NODE_ID": "worker-a",
    }
    config = tiny_config(tmp_path)
    first = start(tmp_path, "first", config, free_port(), **common)
    try:
        wait_until(
            lambda: (scrape_value(first.port, "speedtronic_train_steps_total") or 0) >= 1,
            180,
            "the first worker to train",
            [first],
        )
        # No master has published a global state yet: training, alive, but not ready.
        assert http_get(first.url("/healthz"))[0] == 200
        assert http_get(first.url("/readyz"))[0] == 503
        owner_file = exchange / "nodes" / "worker-a" / "owner.json"
        first_instance = json.loads(owner_file.read_text())["instance"]
        env = run_env(tmp_path, SPEEDTRONIC_METRICS__PORT=str(free_port()), **common)
        second = run_speedtronic("run", "--config", str(config), env=env, cwd=tmp_path)
        lines = [line for line in second.stderr.splitlines() if line.strip()]
        assert second.returncode == 2, second.stderr[-3000:] + second.stdout[-3000:]
        assert lines[-1].startswith("error: distributed.node_id") and "worker-a" in lines[-1]
        assert '"train_step' not in second.stdout and "train_step step=" not in second.stdout
        assert first.alive(), "the original worker must keep training"
        # The newcomer must not take the id over from the live node on its way out.
        assert json.loads(owner_file.read_text())["instance"] == first_instance
        first.process.send_signal(signal.SIGTERM)
        assert first.process.wait(timeout=120) == 0, first.output()[-3000:]
    finally:
        first.kill()
