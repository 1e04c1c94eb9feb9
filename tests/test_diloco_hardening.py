# ruff: noqa: F811  (pytest fixtures imported from tests.hub_emulator_fixtures)
"""What the exchange may hand a node or the master, and what is refused (issue 12's DiLoCo
rows): bounded and finite deltas and globals, file sizes checked before reading, wire dtypes,
contribution identity, torn publishes, model mismatches and permanent misconfigurations.

Each test plants the bad input exactly as a careless or hostile writer to the exchange could.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hub_emulator_fixtures import TEST_TOKEN, fast_retry, hub_emulator  # noqa: F401
from process_support import child_env
from test_diloco_master import Log, bootstrap, deliver, lines, make_master, published

from speedtronic.config import ConfigError, DistributedConfig
from speedtronic.diloco.codec import delta_from_bytes, state_to_bytes
from speedtronic.diloco.coordinator import DumbDiLoCoCoordinator
from speedtronic.diloco.directory import DirectoryTransport
from speedtronic.diloco.exchange import GLOBAL_STEP, ExchangeError
from speedtronic.diloco.node import GlobalCandidate
from speedtronic.retry import TransportError

ROOT = Path(__file__).resolve().parents[1]


def test_huge_finite_deltas_are_refused_and_the_global_stays_finite(tmp_path, caplog):
    master, t, _ = make_master(tmp_path)
    bootstrap(master, t, "a", "b")
    deliver(t, "a", 0, [3e38, 0.0])  # finite in fp32, far beyond any real update
    deliver(t, "b", 0, [2e38, 2e38])  # two of these would sum to inf
    assert master.poll_once() is False  # nothing usable: no round, nothing published
    assert published(t) == [0.0, 0.0]
    assert t.delta_paths() == []  # refused files are pruned, never read again
    warned = " ".join(m for lvl, m in lines(caplog) if lvl == "warning")
    assert "beyond the bound" in warned
    deliver(t, "a", 1, [1.0, 1.0])  # the nodes' next contributions still count
    deliver(t, "b", 1, [3.0, 3.0])
    assert master.poll_once() is False  # round 0 is still open: round 1 files wait
    deliver(t, "a", 0, [2.0, 2.0])
    deliver(t, "b", 0, [2.0, 4.0])
    assert master.poll_once() is True and published(t) == [-2.0, -3.0]


def test_an_outer_step_that_would_leave_the_global_non_finite_is_undone(tmp_path, caplog):
    start = torch.full((2,), 3.0e38)
    master, t, _ = make_master(tmp_path, state={"w": start.clone()})
    bootstrap(master, t, "a")
    deliver(t, "a", 0, [-9.0e3, 1.0])  # a valid delta ...
    master.state.optimizer.lr = 1.0e35  # ... and an outer lr large enough to overflow the step
    assert master.poll_once() is False
    assert master.outer_step == 0 and torch.equal(t.read_global()["w"], start)
    assert any("non-finite" in m for lvl, m in lines(caplog) if lvl == "warning")


def test_a_sparse_giant_file_posing_as_a_delta_is_refused_unread(tmp_path, caplog):
    master, t, _ = make_master(tmp_path)
    bootstrap(master, t, "a")
    deliver(t, "a", 0, [1.0, 1.0])
    giant = tmp_path / "repo/nodes/a/delta_0.safetensors"
    with open(giant, "r+b") as handle:  # 3 GB, no disk blocks: a hostile or broken writer
        handle.truncate(3 << 30)
    reads = []
    original = t.local_copy
    t.local_copy = lambda path, **bound: reads.append(path) or original(path, **bound)
    assert master.poll_once() is False
    assert reads == [] and not giant.exists()
    assert any("more than a delta of this model" in m for lvl, m in lines(caplog))


def test_a_delta_that_grew_after_the_listing_is_refused_on_the_file_read(tmp_path, caplog):
    """The size bound holds on the file the master opens, not only on the listing (issue 20):
    a file that is small when listed and huge when read is refused, counted and pruned, and
    the round does not stall on it."""
    master, t, _ = make_master(tmp_path)
    bootstrap(master, t, "a")
    deliver(t, "a", 0, [1.0, 1.0])
    giant = tmp_path / "repo/nodes/a/delta_0.safetensors"
    listed = t.scan

    def scan_then_grow():
        scan = listed()  # the listing sees the honest size ...
        with open(giant, "r+b") as handle:  # ... then the file grows to 3 GB (sparse)
            handle.truncate(3 << 30)
        return scan

    t.scan = scan_then_grow
    assert master.poll_once() is False
    assert master.outer_step == 0 and not giant.exists()
    assert any("delta_0" in m and "bytes" in m for lvl, m in lines(caplog) if lvl == "warning")


def test_integer_and_boolean_tensors_are_not_deltas():
    for bad in (torch.ones(2, dtype=torch.int64), torch.ones(2, dtype=torch.bool)):
        data = state_to_bytes({"w": bad})
        with pytest.raises(ValueError, match="fp32, bf16 or fp16"):
            delta_from_bytes(data)


def test_contribution_identity_rules(tmp_path, caplog):
    master, t, _ = make_master(tmp_path)
    t.claim_owner("a", {"instance": "a-1", "state": "training"})
    master.poll_once()

    def plant(label, values, **header):
        meta = {"node_id": "a", "round": label, "base_outer_step": 0, "run_id": master.run_id}
        meta["instance"] = "a-1"
        meta.update(header)
        data = state_to_bytes({"w": torch.tensor(values)}, metadata=meta)
        t.commit({f"nodes/a/delta_{label}.safetensors": data})

    plant(0, [5.0, 5.0], base_outer_step=10**9)  # based on a global never published
    master.poll_once()
    assert published(t) == [0.0, 0.0]
    plant(0, [6.0, 6.0], instance="someone-else")  # not the node's current instance
    master.poll_once()
    plant(0, [7.0, 7.0], node_id="b")  # a header that names another node
    master.poll_once()
    assert published(t) == [0.0, 0.0] and master.outer_step == 0
    warned = " ".join(m for lvl, m in lines(caplog) if lvl == "warning")
    assert "never published" in warned and "instance someone-else" in warned
    assert "another node" in warned
    plant(0, [1.0, 1.0], instance="a-1")
    assert master.poll_once() is True and published(t) == [-1.0, -1.0]
    plant(1, [1.0, 1.0], instance="a-1")  # the same values again, under a new round
    assert master.poll_once() is False and published(t) == [-1.0, -1.0]
    assert any("same values" in m for lvl, m in lines(caplog))


def _worker(tmp_path, store):
    """A worker coordinator (a 2 -> 1 linear model) on ``store``, for globals it must refuse."""
    log = Log()
    model = torch.nn.Linear(2, 1, bias=False)
    worker = DumbDiLoCoCoordinator(
        DistributedConfig(
            enabled=True,
            repo_id=f"file://{tmp_path}/repo",
            role="worker",
            node_id="w",
            round_timeout=0.2,
            poll_interval=0.05,
            async_global_poll=False,
        ),
        model,
        hub=store,
        state_dir=tmp_path / "w",
        logger=log,
        environ={},
    )
    return worker, model, log


def test_a_nan_global_is_refused_by_workers_and_by_a_master_without_state(tmp_path):
    t = DirectoryTransport(f"file://{tmp_path}/repo", fast_retry())
    t.publish_global({"w": torch.tensor([float("nan"), 1.0])}, outer_step=4, run_id="r")
    with pytest.raises(TransportError, match="non-finite") as info:
        t.fetch_global()
    assert info.value.kind == "permanent"
    # a worker refuses it once, keeps its weights, and is not ready
    worker, model, log = _worker(tmp_path, t)
    before = model.weight.detach().clone()
    worker.start(0)
    assert not worker.is_ready() and torch.equal(model.weight, before)
    assert [e for e, _ in log.events].count("global_rejected") == 1
    worker.stop()
    # a master with no local state cannot adopt it, and never bootstraps over it
    fresh, _, _ = make_master(tmp_path / "m", transport=t, state={"w": torch.zeros(2)})
    with pytest.raises(ExchangeError, match="non-finite"):  # exit 2, one line (issue 20)
        fresh.reconcile()
    assert t.global_metadata().outer_step == 4


def test_a_worker_refuses_a_global_finite_in_float64_but_not_in_its_float32_model(tmp_path):
    """The finiteness check is made in the dtype the global is installed in (issue 20): a
    float64 1e300 passes a check in the file's dtype and becomes inf in a float32 model."""
    t = DirectoryTransport(f"file://{tmp_path}/repo", fast_retry())
    huge = torch.tensor([[1e300, 0.5]], dtype=torch.float64)
    t.publish_global({"weight": huge}, outer_step=4, run_id="r")
    worker, model, log = _worker(tmp_path, t)
    before = model.weight.detach().clone()
    worker.start(0)
    try:
        assert not worker.is_ready() and torch.equal(model.weight, before)
        assert torch.isfinite(model.weight).all()
        assert [e for e, _ in log.events].count("global_rejected") == 1
    finally:
        worker.stop()


def test_a_master_with_state_republishes_over_a_nan_global(tmp_path, caplog):
    master, t, _ = make_master(tmp_path)
    bootstrap(master, t, "a")
    deliver(t, "a", 0, [1.0, 1.0])
    master.poll_once()
    t.publish_global({"w": torch.tensor([float("nan"), 0.0]), "n": torch.tensor(3)}, outer_step=7)
    again, _, _ = make_master(tmp_path, transport=t)
    again.reconcile()
    assert published(t) == [-1.0, -1.0] and t.global_metadata().outer_step == 1
    assert any("non-finite" in m for lvl, m in lines(caplog) if lvl == "error")


def test_a_torn_publish_is_repaired_from_the_weights_own_header(tmp_path):
    master, t, _ = make_master(tmp_path)
    bootstrap(master, t, "a")
    record = (tmp_path / "repo" / GLOBAL_STEP).read_bytes()
    deliver(t, "a", 0, [1.0, 1.0])
    master.poll_once()  # publishes global 1
    (tmp_path / "repo" / GLOBAL_STEP).write_bytes(record)  # the record's rename was lost
    shutil.rmtree(tmp_path / "state")  # ... and so was the master's disk (files and folders)
    meta, state = t.fetch_global()  # readers trust the newer weights' own header
    assert meta.outer_step == 1 and state["w"].tolist() == [-1.0, -1.0]
    again, _, _ = make_master(tmp_path, transport=t)
    again.poll_once()
    assert again.outer_step == 1
    assert json.loads((tmp_path / "repo" / GLOBAL_STEP).read_text())["outer_step"] == 1
    assert t.fetch_global()[0].sha256 == t.global_metadata().sha256  # consistent again


def test_a_node_with_another_model_stops_with_a_clear_error(tmp_path):
    settings = DistributedConfig(enabled=True, repo_id=f"file://{tmp_path}/r", role="worker")
    model = torch.nn.Linear(3, 2, bias=False)
    coordinator = DumbDiLoCoCoordinator(
        settings, model, state_dir=tmp_path / "s", logger=Log(), environ={}
    )
    wrong = GlobalCandidate(1, {"weight": torch.zeros(4, 3)})
    with pytest.raises(ExchangeError, match=r"weight is \(2, 3\) here and \(4, 3\) in the global"):
        coordinator.node.merge(wrong)
    assert issubclass(ExchangeError, ConfigError)  # exit code 2 from the CLI


def test_an_unusable_exchange_directory_stops_the_node(tmp_path):
    settings = DistributedConfig(
        enabled=True, repo_id="file:///proc/speedtronic-exchange", role="master", node_id="m"
    )
    coordinator = DumbDiLoCoCoordinator(
        settings, torch.nn.Linear(2, 1), state_dir=tmp_path, logger=Log(), environ={}
    )
    with pytest.raises(ExchangeError, match="cannot"):
        coordinator.start(0)


def _run(args: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "speedtronic", "train", "--config", str(ROOT / "configs/smoke.yaml"),
         "--max-steps", "4", "--set", "distributed.enabled=true", *args],
        capture_output=True, text=True, env=env, cwd=cwd, timeout=240,
    )  # fmt: skip


@pytest.mark.slow
def test_permanent_misconfigurations_exit_2_with_one_line(tmp_path, hub_emulator):
    cases = [
        (["--set", "distributed.repo_id=file:///proc/xch"], child_env()),
        (["--set", "distributed.repo_id=a/b/c"], child_env(HF_ENDPOINT=hub_emulator.url)),
        (
            ["--set", "distributed.repo_id=org/run", "--set", "distributed.role=master"],
            child_env(HF_ENDPOINT=hub_emulator.url, HF_TOKEN="hf_wrong_token_value_123"),
        ),
    ]
    for args, env in cases:
        args = [*args, "--output-dir", str(tmp_path / "out"), "--set", "distributed.retry_max=0.1"]
        done = _run([*args, "--set", "distributed.retry_initial=0.05"], env, tmp_path)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 2, done.stderr[-2000:]
        assert lines[-1].startswith("error: distributed.repo_id"), lines[-1]
        assert "Traceback" not in done.stderr
        assert "hf_wrong_token_value_123" not in done.stdout + done.stderr
        assert TEST_TOKEN not in done.stdout + done.stderr
