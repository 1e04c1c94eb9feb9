"""Checkpoint state as registered parts: the layout on disk and loading in place, in order."""

from __future__ import annotations

import io

import torch
from torch import nn

from speedtronic.checkpoint import CheckpointManager, CheckpointParts
from speedtronic.metrics.logger import MetricLogger
from speedtronic.train.trainer import Trainer, TrainerOptions

# The keys of a "speedtronic-checkpoint/1" file as the code before the parts wrote them.
V1_KEYS = {
    "format", "model", "optimizer", "scheduler", "scaler", "step", "samples", "tokens",
    "skipped_updates", "data", "rng", "coordinator", "precision", "config", "versions",
    "tokenizer",  # added (optional on load) so a checkpoint carries its tokenizer (issue 29)
    "evals",  # added (optional on load): its run's held-out evaluations (issue 39, item 17)
}  # fmt: skip


class Recorder:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log, self.value = name, log, {"v": name}

    def state_dict(self) -> dict:
        return dict(self.value)

    def load_state_dict(self, state: dict) -> None:
        self.log.append(self.name)
        self.value = dict(state)


def test_parts_save_under_their_names_the_root_at_the_top_and_load_in_order() -> None:
    log: list = []
    root, first, last = Recorder("root", log), Recorder("a", log), Recorder("b", log)
    parts = CheckpointParts({"root": root, "a": first, "none": None, "b": last}, root="root")
    state = parts.state_dict()
    assert state == {"v": "root", "a": {"v": "a"}, "none": None, "b": {"v": "b"}}
    parts.load_state_dict({"v": "root2", "a": {"v": "a2"}, "b": None})
    assert log == ["root", "a"] and first.value == {"v": "a2"} and root.value["v"] == "root2"


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)

    def forward(self, inputs, labels):
        logits = self.head(self.emb(inputs))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def batches(n: int = 12) -> list:
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 16, (2, 6), generator=g),) * 2 for _ in range(n)]


def make_trainer(tmp_path, model: nn.Module) -> Trainer:
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    return Trainer(
        model,
        optimizer,
        batches(),
        logger=MetricLogger(stream=io.StringIO()),
        scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.9),
        checkpoint_manager=CheckpointManager(tmp_path, every_steps=2, keep_last=None),
        options=TrainerOptions(max_steps=4),
    )


def test_trainer_file_keeps_the_v1_layout_and_resume_loads_every_part_in_place(tmp_path):
    torch.manual_seed(0)
    first = make_trainer(tmp_path, TinyLM())
    first.fit(2)
    state = CheckpointManager(tmp_path).load_latest()
    assert set(state) - {"path"} == V1_KEYS and state["format"] == "speedtronic-checkpoint/1"
    assert state["data"] == {"batches": 2, "loader": None} and state["step"] == 2
    expected = first.fit(4)

    torch.manual_seed(123)  # the checkpoint's RNG state must win over this
    second = make_trainer(tmp_path / "other", TinyLM())
    second.resume(state)
    assert (second.step, second.data.consumed) == (2, 2)
    assert second.scheduler.last_epoch == 2 and second.optimizer.state  # loaded, not pending
    resumed = second.fit(4)
    assert [m["loss"] for m in resumed.metrics] == [m["loss"] for m in expected.metrics]
