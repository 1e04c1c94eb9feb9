# ruff: noqa: F811  (pytest fixtures imported from tests.hub_emulator_fixtures)
"""End-to-end DumbDiLoCo: a master and two workers as separate ``python -m speedtronic train``
processes, over the shared-volume transport and over the Hub emulator, plus a fault run
(30% injected 5xx/dropped connections, SIGKILL + restart of a worker and of the master).

Kept small for CI (2 cores): tiny model, learnable text, inner_steps 3, fast polls/retries.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hub_emulator_fixtures import TEST_TOKEN, hub_emulator  # noqa: F401

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TEXT = "the quick brown fox jumps over the lazy dog. " * 400


_RUNNING: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _reap_processes():
    """Never leave a training process behind, even when a test fails."""
    yield
    while _RUNNING:
        proc = _RUNNING.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait(60)


class Node:
    """One ``speedtronic train`` process and its files."""

    def __init__(
        self,
        tmp: Path,
        name: str,
        role: str,
        repo: str,
        steps: int,
        env: dict,
        extra: tuple[str, ...] = (),
    ):
        self.tmp, self.name, self.role, self.repo, self.steps = tmp, name, role, repo, steps
        self.env, self.extra = env, extra
        self.jsonl = tmp / f"{name}.jsonl"
        self.out = tmp / f"{name}.out"
        self.proc: subprocess.Popen | None = None

    def start(self, resume: bool = False) -> Node:
        text = self.tmp / "corpus.txt"
        if not text.exists():
            text.write_text(TEXT)
        args = [
            sys.executable,
            "-m",
            "speedtronic",
            "train",
            "--config",
            str(ROOT / "configs/diloco.yaml"),
            "--max-steps",
            str(self.steps),
            "--output-dir",
            str(self.tmp / self.name),
            "--set",
            f"distributed.role={self.role}",
            "--set",
            f"distributed.node_id={self.name}",
            "--set",
            f"distributed.repo_id={self.repo}",
            "--set",
            "distributed.inner_steps=3",
            "--set",
            "distributed.poll_interval=0.2",
            "--set",
            "distributed.retry_initial=0.05",
            "--set",
            "distributed.retry_max=0.2",
            "--set",
            "distributed.retry_attempts=8",
            "--set",
            "distributed.request_timeout=5",
            "--set",
            "distributed.outer_lr=1.0",
            "--set",
            "distributed.outer_momentum=0.0",
            "--set",
            f"distributed.cache_dir={self.tmp / 'hubcache' / self.name}",
            "--set",
            f"data.text_path={text}",
            "--set",
            "data.synthetic=false",
            "--set",
            "model.vocab_size=256",
            "--set",
            "optimizer.lr=3e-3",
            "--set",
            "checkpoint.every_steps=3",
            "--set",
            "logging.every_steps=1",
            "--set",
            f"logging.json_file={self.jsonl}",
        ]
        for item in self.extra:
            args += ["--set", item]
        if resume:
            args.append("--resume")
        with open(self.out, "ab") as out:
            self.proc = subprocess.Popen(
                args, cwd=self.tmp, env=self.env, stdout=out, stderr=subprocess.STDOUT
            )
            _RUNNING.append(self.proc)
        return self

    def events(self, name: str | None = None) -> list[dict]:
        if not self.jsonl.exists():
            return []
        rows = []
        for line in self.jsonl.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a SIGKILL may cut the last line
            if name is None or row.get("event") == name:
                rows.append(row)
        return rows

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(
                f"{self.name} did not finish: {self.out.read_text()[-3000:]}"
            ) from None

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(60)  # a process in an fsync can take a while to die


def _env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPEEDTRONIC_", "HF_"))}
    env.update(
        {
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
            "HF_TOKEN": TEST_TOKEN,
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update(extra or {})
    return env


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _losses(node: Node) -> list[float]:
    return [row["loss"] for row in node.events("train_step")]


def _included(master: Node) -> list[tuple[str, int, int]]:
    out = []
    for row in master.events("outer_step"):
        for item in row.get("included", []):
            node, step, base = item.split("/")
            out.append((node, int(step), int(base)))
    return out


def _assert_no_token(tmp: Path) -> None:
    needle = TEST_TOKEN.encode()
    for path in tmp.rglob("*"):
        if path.is_file():
            assert needle not in path.read_bytes(), f"token leaked into {path}"


def _run_three(tmp: Path, repo: str, env: dict, read_processed, steps: int = 18):
    """Master (until SIGTERM) + two workers (``steps`` each); the master is stopped once it
    has aggregated each worker's last upload."""
    # A pure aggregator (it never reaches a boundary), so the global improves only through
    # the workers' deltas and their loss curves show the rounds working.
    master = Node(tmp, "m", "master", repo, 100_000, env, ("distributed.inner_steps=1000000",))
    master.start()
    _wait_for(lambda: bool(master.events("diloco_started")), 180, "the master to start")
    workers = [Node(tmp, f"w{i}", "worker", repo, steps, env).start() for i in (1, 2)]
    for node in workers:
        assert node.wait(240) == 0, node.out.read_text()[-3000:]
    _wait_for(
        lambda: _last_uploads_aggregated(workers, read_processed()),
        120,
        "the master to aggregate the last worker deltas",
    )
    master.proc.send_signal(signal.SIGTERM)  # graceful stop: final checkpoint, exit 0
    assert master.wait(60) == 0, master.out.read_text()[-3000:]
    return master, workers


def _last_uploads_aggregated(workers: list[Node], ledger: list[tuple[str, int, int]]) -> bool:
    done = {(n, s) for n, s, _ in ledger}
    return all((w.name, w.events("delta_uploaded")[-1]["step"]) in done for w in workers)


def _check_training(master: Node, workers: list[Node]) -> None:
    rounds = [row["outer_step"] for row in master.events("outer_step")]
    assert max(rounds) >= 3, rounds
    assert rounds == sorted(rounds)
    for worker in workers:
        pulled = [row["outer_step"] for row in worker.events("global_pulled")]
        assert pulled and pulled == sorted(pulled) and pulled[-1] > pulled[0], pulled
        losses = _losses(worker)
        assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.2, losses
        assert worker.events("delta_uploaded")
    included = _included(master)
    assert len(included) == len(set(included))
    assert {n for n, _, _ in included} == {"w1", "w2"}


def test_master_and_two_workers_over_shared_volume(tmp_path):
    repo = f"file://{tmp_path / 'exchange'}"
    processed = tmp_path / "exchange/global/processed.json"

    def read_processed():
        return _ledger({"global/processed.json": processed.read_bytes()})

    master, workers = _run_three(tmp_path, repo, _env(), read_processed)
    _check_training(master, workers)
    step_count = json.loads((tmp_path / "exchange/global/step_count.json").read_text())
    assert step_count["outer_step"] >= 3
    _assert_no_token(tmp_path)


def test_master_and_two_workers_over_hub_emulator(tmp_path, hub_emulator):
    env = _env({"HF_ENDPOINT": hub_emulator.url})
    master, workers = _run_three(
        tmp_path, "org/diloco-e2e", env, lambda: _ledger(hub_emulator.files("org/diloco-e2e"))
    )
    _check_training(master, workers)
    files = hub_emulator.files("org/diloco-e2e")
    assert json.loads(files["global/step_count.json"])["outer_step"] >= 3
    assert hub_emulator.repos["org/diloco-e2e"].private
    _assert_no_token(tmp_path)


def test_faults_kills_and_restarts_over_hub_emulator(tmp_path, hub_emulator):
    hub_emulator.set_faults(error_rate=0.2, drop_rate=0.1, seed=7)
    env = _env({"HF_ENDPOINT": hub_emulator.url})
    repo = "org/diloco-faults"
    master = Node(tmp_path, "m", "master", repo, 100_000, env, ("checkpoint.every_steps=10",))
    master.start()
    _wait_for(lambda: bool(master.events("diloco_started")), 180, "the master to start")
    w1 = Node(tmp_path, "w1", "worker", repo, 150, env).start()
    w2 = Node(tmp_path, "w2", "worker", repo, 150, env).start()

    _wait_for(lambda: bool(w1.events("delta_uploaded")), 180, "a w1 upload")
    assert w1.proc.poll() is None, "w1 finished before it could be killed"
    w1.kill()
    w1.start(resume=True)
    _wait_for(
        lambda: max([r["outer_step"] for r in master.events("outer_step")] or [0]) >= 2,
        180,
        "two outer rounds",
    )
    master.kill()
    master.start(resume=True)
    for worker in (w1, w2):
        assert worker.wait(240) == 0, worker.out.read_text()[-3000:]

    _wait_for(
        lambda: _last_uploads_aggregated([w1, w2], _ledger(hub_emulator.files(repo))),
        120,
        "the master to aggregate the last worker deltas",
    )
    master.proc.send_signal(signal.SIGTERM)  # graceful stop
    assert master.wait(60) == 0, master.out.read_text()[-3000:]

    ledger = _ledger(hub_emulator.files(repo))
    assert len(ledger) == len(set(ledger))
    included = _included(master)
    assert len(included) == len(set(included)), "a delta was aggregated twice"
    processed_steps = {(n, s) for n, s, _ in ledger}
    for worker in (w1, w2):
        uploaded = {row["step"] for row in worker.events("delta_uploaded")}
        assert {(worker.name, s) for s in uploaded} <= processed_steps
        # a failed upload is carried: a later upload of the same worker was aggregated
        for row in worker.events("delta_upload_failed"):
            assert any(n == worker.name and s > row["step"] for n, s in processed_steps)
    counts = hub_emulator.stats()["counts"]
    assert counts.get("fault:error", 0) > 0 and counts.get("fault:drop", 0) > 0
    assert any(master.events("transport_retry")) or any(w1.events("transport_retry"))
    _assert_no_token(tmp_path)


def _ledger(files: dict[str, bytes]) -> list[tuple[str, int, int]]:
    if "global/processed.json" not in files:
        return []
    data = json.loads(files["global/processed.json"])
    return [(n, int(s), int(b)) for n, s, b in data["processed"]]
