"""The README's three-process loop, run as a user runs it: every round holds all three nodes
(issue 29 item 3).

The loop is read from README.md and run by bash, unchanged, with ``speedtronic`` on the PATH,
in a folder of its own where ``configs/`` is the repository's. Only what a user of the README
would change by environment is changed: the exchange (``SPEEDTRONIC_DISTRIBUTED__REPO_ID``, a
folder of this test's, not ``/tmp/speedtronic-exchange``) and the length
(``SPEEDTRONIC_RUN__MAX_STEPS``: three rounds of ``configs/diloco.yaml``'s 20 inner steps: the
first, which used to close before the workers had started, one between, and the final one).
The thread count is left to the processes. Each run gets a new folder (one run per folder,
whatever a second run into the same folder does); the exchange is the same for every run.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from process_support import STARTED, jsonl_events

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
NODES = ("master", "w1", "w2")
INNER = 20  # configs/diloco.yaml's distributed.inner_steps
ROUNDS = 3
LOOP_TIMEOUT = 300.0  # seconds; a run takes ~20 s on an idle 2-core machine


def readme_loop() -> str:
    """The loop as README.md shows it (the code block under its heading)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("### DumbDiLoCo on one machine, as separate processes", 1)[1]
    block = section.split("```", 2)[1].strip()
    assert block.startswith("for node in master w1 w2"), block
    return block


def _env(exchange: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPEEDTRONIC_", "HF_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(
        {
            "PYTHONPATH": str(ROOT),
            "PYTHONUNBUFFERED": "1",
            "SPEEDTRONIC_DISTRIBUTED__REPO_ID": f"file://{exchange}",
            "SPEEDTRONIC_RUN__MAX_STEPS": str(ROUNDS * INNER),
        }
    )
    return env


def _start_group(args: list[str], cwd: Path, env: dict[str, str], out: Path) -> subprocess.Popen:
    with open(out, "ab") as handle:
        proc = subprocess.Popen(
            args, cwd=cwd, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
        )
    STARTED.append(proc)  # reaped with its group (bash and its trainers, or a CPU hog)
    return proc


def run_readme_loop(folder: Path, exchange: Path) -> Path:
    """Run the README's loop in ``folder`` (its ``configs/`` the repository's) until every
    process exited; returns the master's event log."""
    folder.mkdir(parents=True)
    (folder / "configs").symlink_to(ROOT / "configs")
    env = _env(exchange)
    script = readme_loop()
    if shutil.which("speedtronic", path=env["PATH"]) is None:  # not installed: the module
        script = script.replace("speedtronic train", f"{sys.executable} -m speedtronic train")
    out = folder / "loop.out"
    proc = _start_group(["bash", "-c", f"set -e\n{script}"], folder, env, out)
    try:
        proc.wait(LOOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"the loop did not finish:\n{out.read_text()[-6000:]}") from None
    assert proc.returncode == 0, out.read_text()[-6000:]
    return folder / "runs" / "master" / "events.jsonl"


def assert_every_round_holds_every_node(events: Path) -> None:
    rounds = jsonl_events(events, "outer_step")
    shown = [(row["round"], row["reason"], row["included"]) for row in rounds]
    assert [row["round"] for row in rounds] == list(range(ROUNDS)), shown
    for r, row in enumerate(rounds):
        assert row["included"] == [f"{node}/{r}" for node in NODES], shown
        assert row["reason"] == "complete", shown
    assert jsonl_events(events, "diloco_final"), "no final global"
    assert (events.parent / "final" / "model.safetensors").exists()
    for node in NODES:  # every process trained its steps to the end (`wait` hides its status)
        end = jsonl_events(events.parents[1] / node / "events.jsonl", "train_end")
        assert [row["steps"] for row in end] == [ROUNDS * INNER], node


def test_the_readme_loop_three_times_over_one_exchange_holds_every_node_in_every_round(
    tmp_path,
):
    """Each run after the first starts a new run over the finished one on the same exchange;
    in every run each round aggregates one contribution from each of the three nodes."""
    exchange = tmp_path / "exchange"
    for attempt in range(3):
        events = run_readme_loop(tmp_path / f"run{attempt}", exchange)
        assert_every_round_holds_every_node(events)


HOG = """
import os, torch
torch.set_num_threads(os.cpu_count() or 1)
a = torch.randn(384, 384)
while True:
    a = torch.tanh(a @ a)
"""


def test_the_readme_loop_beside_a_cpu_heavy_process_holds_every_node_in_every_round(tmp_path):
    """A process that keeps every core busy slows every node (and their start) down: the
    rounds still wait for all three."""
    hog = _start_group([sys.executable, "-c", HOG], tmp_path, dict(os.environ), tmp_path / "hog")
    events = run_readme_loop(tmp_path / "run", tmp_path / "exchange")
    assert hog.poll() is None, "the CPU-heavy process stopped early"
    assert_every_round_holds_every_node(events)
