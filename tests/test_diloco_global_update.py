"""The global's download as a quantized outer update (``distributed.global_dtype``).

A real master over a shared-volume exchange closes rounds; nodes fetch each global through
their :class:`NodeLink` as workers do. Every node must end each round on the master's global
bit for bit, whether it applied the update or downloaded the full global, and an update it
cannot use (damaged, of another base, not the one the record names) must leave it on the
full global, never on other weights.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch
from test_diloco_master import deliver, join, make_master

from speedtronic.diloco import exchange as T
from speedtronic.diloco.codec import (
    open_safetensors,
    read_metadata,
    state_digest,
    write_safetensors,
)
from speedtronic.diloco.ledger import OuterStateStore
from speedtronic.diloco.link import NodeClaim, NodeLink

N = 300  # values of "w": three blocks of 128 and a short one


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"w": torch.randn(N, generator=gen), "n": torch.tensor(3)}


def _link(tmp_path, t, master, node: str, log=None) -> NodeLink:
    return NodeLink(
        t,
        master.settings,
        claim=NodeClaim(node, "worker", tmp_path / node),
        max_bytes=T.max_global_bytes(master.global_state),
        like=_state(),
        interrupted=threading.Event(),
        emit=log.emit if log is not None else T.ignore,
    )


def _round(master, t, nodes, r: int) -> None:
    gen = torch.Generator().manual_seed(100 + r)
    for node in nodes:
        deliver(t, node, r, (torch.randn(N, generator=gen) * 0.01).tolist())
    assert master.poll_once() is True


def _same(candidate, master) -> None:
    assert candidate.outer_step == master.outer_step
    assert set(candidate.state) == set(master.global_state)
    for key, value in master.global_state.items():
        assert candidate.state[key].dtype == value.dtype
        assert torch.equal(candidate.state[key], value), key  # bit for bit


def _started(tmp_path, wire="int8", **overrides):
    master, t, log = make_master(tmp_path, state=_state(), global_dtype=wire, **overrides)
    for node in ("a", "b"):
        join(t, node)
    assert master.poll_once() is False  # global 0
    return master, t, log


@pytest.mark.parametrize("wire", ["int8", "int4"])
def test_every_node_ends_each_round_on_the_masters_global_bit_for_bit(tmp_path, wire):
    master, t, log = _started(tmp_path, wire)
    links = {node: _link(tmp_path, t, master, node, log) for node in ("a", "b")}
    seen = {}
    for node, link in links.items():
        seen[node] = link.fetch((-1, ""))
        assert seen[node].source == "full"
        _same(seen[node], master)
    full = T.max_global_bytes(master.global_state) - (1 << 20)
    for r in range(4):
        if r == 2:  # a node joining late has no global to apply the update to
            links["c"] = _link(tmp_path, t, master, "c")
            join(t, "c")
        _round(master, t, sorted(links), r)
        assert read_metadata(t.root / T.update_path(r + 1))["outer_step"] == str(r + 1)
        published = t.read_global()  # the full global, for joiners, is the same weights
        assert all(torch.equal(published[k], v) for k, v in master.global_state.items())
        for node, link in links.items():
            last = seen.get(node)
            candidate = link.fetch((-1, "") if last is None else (last.outer_step, last.run_id))
            _same(candidate, master)
            assert candidate.source == ("update" if last is not None else "full"), node
            assert (candidate.nbytes < full) == (candidate.source == "update")
            seen[node] = candidate
    # the update moved the global: the round's arithmetic, as the master did it
    assert not torch.equal(master.global_state["w"], _state()["w"])
    assert not log.of("global_update_refused")


def test_fp32_publishes_no_update_and_keeps_no_copy(tmp_path):
    master, t, _ = _started(tmp_path, "fp32")
    link = _link(tmp_path, t, master, "a")
    first = link.fetch((-1, ""))
    _round(master, t, ["a", "b"], 0)
    record = json.loads((t.root / T.GLOBAL_STEP).read_text())
    assert "update_sha256" not in record and not list((t.root / "global").glob("update*"))
    candidate = link.fetch((first.outer_step, first.run_id))
    assert candidate.source == "full" and link.held is None
    _same(candidate, master)


def _rewrite(t, change) -> None:
    """Rewrite the published update with ``change(tensors, header)`` applied, and name the
    new file in the version record (so only the deeper checks can refuse it)."""
    path = t.root / T.update_path(t.global_metadata().outer_step)
    with open_safetensors(path) as opened:
        header = opened.metadata()
        tensors = {key: opened.get_tensor(key) for key in opened}
    change(tensors, header)
    with open(path, "wb") as handle:
        sha = write_safetensors(handle, tensors, metadata=header)
    record = json.loads((t.root / T.GLOBAL_STEP).read_text())
    record["update_sha256"] = sha
    (t.root / T.GLOBAL_STEP).write_text(json.dumps(record))


def _scale(tensors, value):
    tensors["w::scale"][1] = value


DEFECTS = {
    "nan scale": lambda ts, h: _scale(ts, float("nan")),
    "huge scale": lambda ts, h: _scale(ts, 1e30),
    "negative scale": lambda ts, h: _scale(ts, -1.0),
    "wrong block count": lambda ts, h: ts.update({"w::scale": ts["w::scale"][:-1]}),
    "code out of range": lambda ts, h: ts["w"].view(-1).__setitem__(5, -128),
    "missing key": lambda ts, h: [ts.pop("w"), ts.pop("w::scale")],
    "another base step": lambda ts, h: h.update(base_outer_step="0"),
    "another base digest": lambda ts, h: h.update(base_digest="0" * 64),
    "another run": lambda ts, h: h.update(run_id="f" * 32),
    "another result": lambda ts, h: h.update(digest="0" * 64),
    "changed codes": lambda ts, h: ts["w"].view(-1).__setitem__(7, 3),
    "no block size": lambda ts, h: h.pop("block_size"),
    "fp32 values": lambda ts, h: h.update(dtype="fp32"),
}


@pytest.mark.parametrize("defect", [*sorted(DEFECTS), "not the recorded file", "missing file"])
def test_an_unusable_update_falls_back_to_the_full_global(tmp_path, defect, monkeypatch):
    monkeypatch.setattr(T, "FULL_GLOBAL_EVERY", 1)  # the weights file is every global
    master, t, log = _started(tmp_path, "int8")
    link = _link(tmp_path, t, master, "a", log)
    seen = link.fetch((-1, ""))
    _round(master, t, ["a", "b"], 0)
    seen = link.fetch((seen.outer_step, seen.run_id))
    assert seen.source == "update"
    _round(master, t, ["a", "b"], 1)  # the defect is planted into global 2's update
    path = t.root / T.update_path(2)
    if defect == "not the recorded file":  # e.g. torn: another update than the record names
        data = bytearray(path.read_bytes())
        data[-1] ^= 1
        path.write_bytes(bytes(data))
    elif defect == "missing file":
        path.unlink()
    else:
        _rewrite(t, DEFECTS[defect])
    candidate = link.fetch((seen.outer_step, seen.run_id))
    assert candidate.source == "full"
    _same(candidate, master)
    assert [row["outer_step"] for row in log.of("global_update_refused")] == [2]  # said once
    # and the node goes on from there: the next round's update applies again
    _round(master, t, ["a", "b"], 2)
    following = link.fetch((candidate.outer_step, candidate.run_id))
    assert following.source == "update"
    _same(following, master)


def test_a_node_that_missed_a_round_downloads_the_full_global(tmp_path, monkeypatch):
    monkeypatch.setattr(T, "FULL_GLOBAL_EVERY", 1)  # only the last update is on the exchange
    master, t, _ = _started(tmp_path, "int4")
    link = _link(tmp_path, t, master, "a")
    seen = link.fetch((-1, ""))
    _round(master, t, ["a", "b"], 0)
    _round(master, t, ["a", "b"], 1)  # global 2's update applies to global 1, never fetched
    candidate = link.fetch((seen.outer_step, seen.run_id))
    assert candidate.source == "full" and candidate.outer_step == 2
    _same(candidate, master)


def test_the_masters_update_residual_survives_a_restart(tmp_path):
    master, t, _ = _started(tmp_path, "int4")
    _round(master, t, ["a", "b"], 0)
    residual = master.state.residual
    assert residual and float(residual["w"].abs().max()) > 0  # int4 leaves something out
    saved = OuterStateStore(tmp_path / "state").load(master.state)
    assert torch.equal(saved.residual["w"], residual["w"])
    header = read_metadata(t.root / T.update_path(1))
    assert header["digest"] == state_digest(master.global_state)
    assert (header["base_outer_step"], header["outer_step"]) == ("0", "1")


def test_without_error_feedback_the_master_keeps_no_residual(tmp_path):
    master, t, _ = _started(tmp_path, "int4", error_feedback=False)
    _round(master, t, ["a", "b"], 0)
    assert master.state.residual == {}


def _follow(link, last):
    return link.fetch((last.outer_step, last.run_id))


def _after_round_0(tmp_path):
    """An int8 master whose round 0 (a and b) closed, and a's link that followed it there:
    ``(master, exchange, log, link, the global the link fetched last)``."""
    master, t, log = _started(tmp_path, "int8")
    link = _link(tmp_path, t, master, "a", log)
    seen = link.fetch((-1, ""))
    _round(master, t, ["a", "b"], 0)
    return master, t, log, link, _follow(link, seen)


def test_a_master_restarted_mid_round_goes_on_publishing_updates_that_apply(tmp_path):
    master, t, _, link, seen = _after_round_0(tmp_path)
    deliver(t, "a", 1, [0.01] * N)
    master.poll_once()  # round 1 open, a delivered; the master dies here
    again, _, _ = make_master(
        tmp_path, transport=t, state=_state(), global_dtype="int8", clock=master._clock
    )
    assert again.outer_step == 1 and again.ledger == {"a": 0, "b": 0}
    assert torch.equal(again.state.residual["w"], master.state.residual["w"])
    deliver(t, "b", 1, [0.02] * N)
    assert again.poll_once() is True and again.ledger == {"a": 1, "b": 1}  # each once
    candidate = _follow(link, seen)
    assert candidate.source == "update"
    _same(candidate, again)


def test_a_failed_publish_is_published_again_as_a_full_global_and_updates_apply_after(tmp_path):
    master, t, log, link, seen = _after_round_0(tmp_path)
    for node in ("a", "b"):
        deliver(t, node, 1, [0.01] * N)
    original = t.publish_global
    t.publish_global = lambda *a, **k: (_ for _ in ()).throw(T.TransportError("hub down"))
    with pytest.raises(T.TransportError):
        master.poll_once()
    t.publish_global = original
    master.poll_once()  # the kept round is published again, without its update
    assert t.global_metadata().outer_step == 2 and not t.global_metadata().update_sha256
    candidate = _follow(link, seen)
    assert candidate.source == "full"
    _same(candidate, master)
    _round(master, t, ["a", "b"], 2)
    following = _follow(link, candidate)
    assert following.source == "update"
    _same(following, master)
    assert not log.of("global_update_refused")  # no update to refuse: the record named none
