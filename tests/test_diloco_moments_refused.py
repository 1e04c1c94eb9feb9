"""The mean first moments a node reads from the exchange are checked like a global (issue 39).

``global/moments.safetensors`` can be planted by anyone who writes to the exchange. A node
installs it only when it holds the moments of exactly the parameters it sent, with their
shapes, finite in their dtypes and within the bound of a contribution's values, and the file
is no larger than float32 moments of the model; otherwise the file is refused once (an error
line and a ``moments_rejected`` event), the global itself is installed, the node keeps its
own moments and trains on. Each test plants the file as a writer to the exchange could,
then reads it through the node's :class:`NodeLink` and merges the global as a worker does.
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from hub_emulator_fixtures import fast_retry
from test_diloco_node import Recorder

from speedtronic.config import DistributedConfig
from speedtronic.diloco import exchange as T
from speedtronic.diloco.codec import write_safetensors
from speedtronic.diloco.directory import DirectoryTransport
from speedtronic.diloco.exchange import RoundSettings
from speedtronic.diloco.link import NodeClaim, NodeLink
from speedtronic.diloco.node import DiLoCoNode, GlobalInbox


def _node(tmp_path):
    """A worker that sent its first moments with round 0 (its upload arrived), its link to a
    shared-volume exchange that holds global 0, and the AdamW whose moments it keeps."""
    settings = RoundSettings.of(
        DistributedConfig(
            inner_steps=1,
            round_timeout=0.2,
            async_delta_upload=False,
            sync="overlapped",
            sync_inner_momentum="every_round",
        )
    )
    model = torch.nn.Linear(2, 1)  # two parameters: weight (1, 2), bias (1,)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    store = DirectoryTransport(f"file://{tmp_path}/repo", fast_retry())
    store.create_repo()
    like = model.state_dict()
    store.publish_global(like, outer_step=0, run_id="r")
    rec = Recorder()
    link = NodeLink(
        store,
        settings,
        claim=NodeClaim("a", "worker", tmp_path / "a"),
        max_bytes=T.max_global_bytes(like),
        like=like,
        interrupted=threading.Event(),
        emit=rec.emit,
    )
    inbox = GlobalInbox(link.fetch, interval=0.0, threaded=False)
    node = DiLoCoNode(settings, model, send=rec.send, inbox=inbox, emit=rec.emit)
    node.bind(optimizer)
    node.merge(link.fetch((-1, "")))  # global 0
    with torch.no_grad():
        model.weight.add_(0.1)
    node.after_optimizer_step()  # round 0: its delta and its first moments, uploaded
    assert sorted(rec.sent[0].delta) == ["bias", "moment::bias", "moment::weight", "weight"]
    return node, link, store, rec, optimizer, model


def _publish(store, model, moments, *, round="0"):
    """Global 1 with ``moments`` as the mean first moments of ``round``."""
    store.publish_global(
        {k: v.detach().clone() for k, v in model.state_dict().items()},
        outer_step=1,
        run_id="r",
        metadata_extra={"moments_round": round},
        moments=moments,
    )


def _plant(store, tensors):
    """Replace the published moments file (its header names global 1, as the master's would)."""
    path = store.root / T.GLOBAL_MOMENTS
    with open(path, "wb") as handle:
        write_safetensors(handle, tensors, metadata={"outer_step": "1"})


def _own(optimizer, model):
    return {n: optimizer.state[p]["exp_avg"].clone() for n, p in model.named_parameters()}


def _good():
    return {"weight": torch.full((1, 2), 0.5), "bias": torch.full((1,), 0.25)}


def test_the_mean_of_the_parameters_this_node_sent_is_installed(tmp_path):
    node, link, store, rec, optimizer, model = _node(tmp_path)
    _publish(store, model, _good())
    candidate = link.fetch((0, "r"))
    assert candidate is not None and candidate.moments is not None
    node.merge(candidate)
    assert node.rounds.installed == 1
    assert optimizer.state[model.weight]["exp_avg"].tolist() == [[0.5, 0.5]]
    assert optimizer.state[model.bias]["exp_avg"].tolist() == [0.25]
    assert "moments_rejected" not in rec.names()


BAD = {
    "nan": {"weight": torch.tensor([[float("nan"), 0.5]]), "bias": torch.zeros(1)},
    "inf": {"weight": torch.tensor([[float("inf"), 0.5]]), "bias": torch.zeros(1)},
    "huge": {"weight": torch.full((1, 2), 1.0e30), "bias": torch.zeros(1)},  # finite
    "shape (1,)": {"weight": torch.full((1,), 9.0), "bias": torch.zeros(1)},  # would broadcast
    "missing key": {"weight": torch.full((1, 2), 0.5)},
    "extra key": {**_good(), "other": torch.zeros(3)},
}


@pytest.mark.parametrize("defect", sorted(BAD))
def test_unusable_moments_are_refused_once_and_the_node_keeps_its_own(tmp_path, caplog, defect):
    node, link, store, rec, optimizer, model = _node(tmp_path)
    own = _own(optimizer, model)
    _publish(store, model, _good())
    _plant(store, BAD[defect])
    with caplog.at_level(logging.ERROR, logger="speedtronic.diloco"):
        node.merge(link.fetch((0, "r")))
    assert node.rounds.installed == 1  # the global itself is installed
    for name, value in _own(optimizer, model).items():
        assert torch.equal(value, own[name]), name  # its own moments, untouched
    assert [name for name in rec.names() if name == "moments_rejected"] == ["moments_rejected"]
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "first moments" in errors[0]
    node.merge(link.fetch((0, "r")))  # the same global read again (a final global is)
    assert rec.names().count("moments_rejected") == 1  # said once
    train_on(node, model, rec)


def train_on(node, model, rec):
    """The node trains its next round and sends finite values."""
    sent = len(rec.sent)
    with torch.no_grad():
        model.weight.add_(0.1)
    node.after_optimizer_step()
    assert len(rec.sent) == sent + 1
    assert all(bool(torch.isfinite(v).all()) for v in rec.sent[-1].delta.values())


def test_an_oversized_or_unreadable_moments_file_is_refused_and_the_global_installed(tmp_path):
    node, link, store, rec, optimizer, model = _node(tmp_path)
    own = _own(optimizer, model)
    _publish(store, model, _good())
    # float32 moments of this model's 3 values + 1 MiB, and a file that is more
    assert T.max_moments_bytes(model.state_dict()) == 4 * 3 + (1 << 20)
    _plant(store, {"weight": torch.zeros((1 << 18) + 16), "bias": torch.zeros(1)})
    candidate = link.fetch((0, "r"))  # before: the poll failed at every try, no global came
    assert candidate is not None and candidate.outer_step == 1 and candidate.moments is None
    node.merge(candidate)
    assert node.rounds.installed == 1
    assert torch.equal(_own(optimizer, model)["weight"], own["weight"])
    assert link.fetch((0, "r")) is not None  # read again: not reported twice
    assert rec.names().count("moments_rejected") == 1
    store.publish_global(
        model.state_dict(), outer_step=2, run_id="r", metadata_extra={"moments_round": "1"}
    )
    (store.root / T.GLOBAL_MOMENTS).write_bytes(b"not a safetensors file")
    candidate = link.fetch((1, "r"))
    assert candidate is not None and candidate.outer_step == 2 and candidate.moments is None
    assert rec.names().count("moments_rejected") == 2
