"""`speedtronic train` end to end: real subprocesses, SIGTERM, resume, bad input."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from speedtronic.config import ResolvedConfig, SpeedtronicConfig
from speedtronic.entrypoint import install_stop_handlers, launch

REPO = Path(__file__).resolve().parents[1]


def speedtronic(*args: str, env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-m", "speedtronic", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def train_smoke(output: Path, *args: str, **kwargs) -> subprocess.Popen:
    """``speedtronic train`` of configs/smoke.yaml into ``output``, with ``args`` after."""
    return speedtronic(
        "train", "--config", "configs/smoke.yaml", "--output-dir", str(output), *args, **kwargs
    )


def events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_smoke_config_end_to_end(tmp_path):
    jsonl = tmp_path / "events.jsonl"
    began = time.monotonic()
    proc = train_smoke(
        tmp_path, "--set", f"logging.json_file={jsonl}", env={"OMP_NUM_THREADS": "1"}
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert time.monotonic() - began < 60
    assert "completed steps=200 samples=400 tokens=12800 loss=" in out
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*.pt")) == [
        "step_000000000100.pt",
        "step_000000000200.pt",
    ]
    assert json.loads((ckpts / "latest.json").read_text())["step"] == 200
    records = events(jsonl)
    names = [e["event"] for e in records]
    assert names.count("train_step") == 200 and names[-1] == "train_end"
    # The shipped default learns: held-out loss falls from ln(128) toward the chain's floor.
    evals = [e for e in records if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [0, 50, 100, 150, 200]
    assert all(e["scope"] == "local" and e["tokens"] == 4096 for e in evals)
    assert evals[0]["loss"] > 4.6 and evals[-1]["loss"] < 2.0
    assert evals[-1]["loss"] < evals[2]["loss"] < evals[0]["loss"]
    train = [e["loss"] for e in records if e["event"] == "train_step"]
    assert sum(train[-20:]) / 20 < 2.0 < 4.6 < sum(train[:5]) / 5
    # resuming at the target does no work and keeps the counters
    proc = train_smoke(tmp_path, "--resume")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    # issue 29: no step ran, so no loss (never printed as None)
    assert "completed steps=200 samples=400 tokens=12800\n" in out and "None" not in out


@pytest.mark.slow
def test_sigterm_stops_gracefully_with_final_checkpoint(tmp_path):
    jsonl = tmp_path / "events.jsonl"
    every = "checkpoint.every_steps=100000"
    proc = train_smoke(
        tmp_path, "--max-steps", "100000", "--set", every, "--set", f"logging.json_file={jsonl}"
    )
    try:
        deadline = time.monotonic() + 90
        while not any(e["event"] == "train_step" for e in events(jsonl)):
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "stopped=SIGTERM" in out
    records = events(jsonl)
    last_step = [e["step"] for e in records if e["event"] == "train_step"][-1]
    stopped = [e for e in records if e["event"] == "train_stopped"]
    assert stopped and stopped[0]["step"] == last_step and stopped[0]["reason"] == "SIGTERM"
    pointer = json.loads((tmp_path / "checkpoints" / "latest.json").read_text())
    assert pointer["step"] == last_step < 100000
    state = torch.load(tmp_path / "checkpoints" / pointer["file"], weights_only=True)
    assert state["step"] == last_step


def test_cuda_request_without_cuda_exits_2(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("machine has CUDA")
    proc = train_smoke(tmp_path, "--set", "run.device=cuda")
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: run.device")


def test_train_command_in_process_with_progress_bar(tmp_path, capsys):
    config = SpeedtronicConfig.from_yaml(REPO / "configs" / "smoke.yaml")
    config.run.output_dir = str(tmp_path)
    config.logging.json_file = str(tmp_path / "e.jsonl")
    config.apply_run_target(4)
    seen = []
    outcome = launch(
        ResolvedConfig(config),
        command="train",
        progress=True,
        extra_hooks=[lambda e, p: seen.append(e)],
    )
    result = outcome.result
    assert outcome.exit_code == 0
    assert result.steps == 4 and result.stopped_reason is None
    captured = capsys.readouterr()
    assert "4/4" in captured.err  # the tqdm bar
    assert "train_step step=" not in captured.out  # step lines go to the bar and JSONL only
    assert seen.count("train_step") == 4
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # handlers restored


def test_stop_handlers_route_signals_and_restore():
    reasons = []
    before = signal.getsignal(signal.SIGUSR1)
    restore = install_stop_handlers(reasons.append, signals=(signal.SIGUSR1,))
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.05)
    restore()
    assert reasons == ["SIGUSR1"] and signal.getsignal(signal.SIGUSR1) == before


def test_node_id_collision_stops_train_with_exit_2(tmp_path):
    """A live node (this test process, on this host) holds ``worker-a``: ``speedtronic train``
    stops before its first step with exit 2 and leaves the claim alone (as ``run`` does)."""
    exchange = tmp_path / "exchange"
    owner = exchange / "nodes" / "worker-a" / "owner.json"
    owner.parent.mkdir(parents=True)
    record = {
        "node_id": "worker-a",
        "instance": "the-live-one",
        "role": "worker",
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "state": "training",
    }
    owner.write_text(json.dumps(record))
    proc = train_smoke(
        tmp_path / "out",
        "--max-steps",
        "3",
        env={
            "OMP_NUM_THREADS": "1",
            "SPEEDTRONIC_DISTRIBUTED__ENABLED": "true",
            "SPEEDTRONIC_DISTRIBUTED__ROLE": "worker",
            "SPEEDTRONIC_DISTRIBUTED__REPO_ID": exchange.as_uri(),
            "SPEEDTRONIC_NODE_ID": "worker-a",
        },
    )
    out, err = proc.communicate(timeout=120)
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 2, err[-3000:]
    assert lines[-1].startswith("error: distributed.node_id") and "worker-a" in lines[-1]
    assert "Traceback" not in err and "completed" not in out
    assert "train_step step=" not in out
    assert json.loads(owner.read_text())["instance"] == "the-live-one"
    assert not list((tmp_path / "out").rglob("*.pt")), "training started"
