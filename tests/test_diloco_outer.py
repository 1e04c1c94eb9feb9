"""Master outer loop: Nesterov golden, aggregation rounds, dedup, corrupt deltas, persistence."""

from __future__ import annotations

import json

import pytest
import torch
from hub_emulator_fixtures import fast_retry

from speedtronic.diloco import tensors as T
from speedtronic.diloco.directory import DirectoryTransport
from speedtronic.diloco.outer import MasterOuterLoop, NesterovOuterOptimizer
from speedtronic.diloco.transport import TransportError


def test_nesterov_first_step_golden():
    state = {"w": torch.tensor([1.0, 1.0])}
    opt = NesterovOuterOptimizer(state, lr=1.0, momentum=0.9)
    opt.step(state, {"w": torch.tensor([0.1, 0.2])})
    assert torch.allclose(state["w"], torch.tensor([0.81, 0.62]))  # w - 1.9 g
    state2 = {"w": torch.tensor([1.0, 1.0])}
    opt2 = NesterovOuterOptimizer(state2, lr=0.1, momentum=0.9)
    opt2.step(state2, {"w": torch.tensor([1.0, 2.0])})
    assert torch.allclose(state2["w"], torch.tensor([0.81, 0.62]))
    opt2.step(state2, {"w": torch.tensor([1.0, 2.0])})
    assert state2["w"].shape == (2,)
    # second step: buf = 0.9*g + g = 1.9g; effective = g + 0.9*1.9g = 2.71g
    assert torch.allclose(state2["w"], torch.tensor([0.81 - 0.271, 0.62 - 0.542]))
    with pytest.raises(KeyError):
        opt.step(state, {"x": torch.ones(2)})


class Log:
    def __init__(self):
        self.events, self.lines = [], []

    def emit(self, event, payload):
        self.events.append((event, dict(payload)))

    def info(self, msg, *a):
        self.lines.append(("info", msg % a if a else msg))

    def warning(self, msg, *a):
        self.lines.append(("warning", msg % a if a else msg))

    def error(self, msg, *a):
        self.lines.append(("error", msg % a if a else msg))


def _loop(tmp_path, transport=None, state=None, lr=1.0, momentum=0.9):
    log = Log()
    transport = transport or DirectoryTransport(f"file://{tmp_path}/repo", fast_retry())
    loop = MasterOuterLoop(
        transport,
        state or {"w": torch.tensor([1.0, 1.0]), "n": torch.tensor(3)},
        node_state_dir=tmp_path / "state",
        outer_lr=lr,
        outer_momentum=momentum,
        emit=log.emit,
        log=log,
    )
    return loop, transport, log


def _upload(t, node, step, base, values):
    t.upload_delta({"w": torch.tensor(values)}, node_id=node, local_step=step, base_outer_step=base)


def test_round_averages_equal_weight_publishes_and_prunes(tmp_path):
    loop, t, log = _loop(tmp_path)
    assert loop.sync_once() == 0  # bootstrap + empty round
    assert t.global_metadata().outer_step == 0
    _upload(t, "a", 5, 0, [0.2, 0.1])
    _upload(t, "b", 5, 0, [0.0, 0.3])
    before = t.commits
    assert loop.sync_once() == 1
    assert t.commits == before + 1  # publish + prune in one commit
    assert torch.allclose(t.read_global()["w"], torch.tensor([0.81, 0.62]))
    assert t.read_global()["n"].item() == 3  # integer buffers published untouched
    assert t.delta_paths() == []
    assert sorted(t.read_processed()) == [("a", 5, 0), ("b", 5, 0)]
    event = [p for e, p in log.events if e == "outer_step"][-1]
    assert event["deltas_found"] == 2 and event["deltas_included"] == 2
    assert sorted(event["included"]) == ["a/5/0", "b/5/0"]


def test_processed_and_corrupt_deltas_are_skipped_and_counted(tmp_path):
    loop, t, log = _loop(tmp_path)
    loop.sync_once()
    _upload(t, "a", 5, 0, [0.1, 0.1])
    loop.sync_once()
    # the same identity again (a replay after a worker restart) must not count twice
    _upload(t, "a", 5, 0, [0.1, 0.1])
    t.commit({"nodes/bad/delta_1.safetensors": b"garbage"})
    _upload(t, "c", 1, 0, [float("nan"), 0.0])
    w_before = t.read_global()["w"].clone()
    assert loop.sync_once() == 1
    assert torch.equal(t.read_global()["w"], w_before)
    event = [p for e, p in log.events if e == "outer_step"][-1]
    assert event["deltas_included"] == 0 and event["deltas_skipped"] == 1
    assert event["deltas_corrupt"] == 2
    warned = " ".join(m for lvl, m in log.lines if lvl == "warning")
    assert "nodes/bad/delta_1.safetensors" in warned and "nodes/c/delta_1.safetensors" in warned
    assert "nodes/a/delta_5.safetensors" not in t.list_files()  # replay pruned


def test_publish_failure_rolls_back(tmp_path):
    loop, t, _ = _loop(tmp_path)
    loop.sync_once()
    _upload(t, "a", 5, 0, [0.1, 0.2])
    original = t.publish_global
    t.publish_global = lambda *a, **k: (_ for _ in ()).throw(TransportError("hub down"))
    with pytest.raises(TransportError):
        loop.sync_once()
    assert loop.outer_step == 0 and not loop.processed_deltas
    assert torch.equal(loop.global_state["w"], torch.tensor([1.0, 1.0]))
    t.publish_global = original
    assert loop.sync_once() == 1
    assert torch.allclose(loop.global_state["w"], torch.tensor([0.81, 0.62]))


def test_local_state_persists_and_master_restart_continues(tmp_path):
    loop, t, _ = _loop(tmp_path)
    loop.sync_once()
    _upload(t, "a", 5, 0, [0.1, 0.2])
    loop.sync_once()
    meta = json.loads((tmp_path / "state/outer_state.json").read_text())
    assert meta["outer_step"] == 1 and meta["processed"] == [["a", 5, 0]]
    again, _, _ = _loop(tmp_path, transport=t)
    assert again.outer_step == 1 and again.processed_deltas == {("a", 5, 0)}
    assert torch.allclose(again.optimizer.momentum_buffers["w"], torch.tensor([0.1, 0.2]))
    _upload(t, "a", 10, 1, [0.1, 0.2])
    assert again.sync_once() == 2


@pytest.mark.parametrize("damage", ["corrupt", "lost"])
def test_corrupt_or_lost_local_state_rebuilds_from_published(tmp_path, damage):
    loop, t, _ = _loop(tmp_path)
    loop.sync_once()
    _upload(t, "a", 5, 0, [0.1, 0.2])
    loop.sync_once()
    published = t.read_global()["w"].clone()
    if damage == "corrupt":
        (tmp_path / "state/outer_state.safetensors").write_bytes(b"\x00garbage")
    else:
        for p in (tmp_path / "state").iterdir():
            p.unlink()
    # the same delta is still in the repo (e.g. the prune commit was lost): not aggregated twice
    _upload(t, "a", 5, 0, [0.1, 0.2])
    rebuilt, _, log = _loop(
        tmp_path, transport=t, state={"w": torch.zeros(2), "n": torch.tensor(3)}
    )
    if damage == "corrupt":
        assert any(lvl == "error" and "corrupt local outer state" in m for lvl, m in log.lines)
        assert list((tmp_path / "state").glob("*.corrupt-*"))
    assert rebuilt.sync_once() == 1
    assert torch.equal(rebuilt.global_state["w"], published)
    assert rebuilt.processed_deltas == {("a", 5, 0)}
    assert (tmp_path / "state/outer_state.json").exists()


def test_unreadable_repository_never_bootstraps_over_it(tmp_path):
    loop, t, _ = _loop(tmp_path)
    loop.sync_once()
    _upload(t, "a", 5, 0, [0.1, 0.2])
    loop.sync_once()
    for p in (tmp_path / "state").iterdir():
        p.unlink()
    fresh, _, _ = _loop(tmp_path, transport=t, state={"w": torch.zeros(2), "n": torch.tensor(3)})
    t.global_metadata = lambda: (_ for _ in ()).throw(TransportError("outage"))
    with pytest.raises(TransportError):
        fresh.sync_once()
    assert T.state_from_bytes(t.read_bytes("global/latest.safetensors"))[0]["w"][0] != 0
