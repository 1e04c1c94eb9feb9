"""Muon / Muon+ / cautious through the real runtime: training, checkpoints and exact resume."""

from __future__ import annotations

import pytest

from speedtronic.optim import CautiousOptimizer, HybridOptimizer
from speedtronic.train.runtime import build_runtime, train_from_config


def _config(tmp_path, optimizer: dict) -> dict:
    return {
        "run": {
            "name": "o",
            "seed": 3,
            "device": "cpu",
            "max_steps": 4,
            "output_dir": str(tmp_path),
        },
        "model": {"vocab_size": 64, "max_seq_len": 16, "n_layer": 1, "n_head": 2, "d_model": 32},
        "data": {"num_tokens": 40, "micro_batch_size": 2, "target_batch_size": 2},
        "optimizer": {"lr": 1e-2, **optimizer},
        "scheduler": {"warmup_steps": 1},
        "precision": "fp32",
        "checkpoint": {"every_steps": 2, "keep_last": 2},
        "logging": {"level": "WARNING"},
    }


@pytest.mark.parametrize(
    "optimizer",
    [{"name": "muon", "muon_plus": True, "cautious": True}, {"name": "adamw", "cautious": True}],
    ids=["muon-plus-cautious", "adamw-cautious"],
)
def test_resume_reproduces_losses_exactly(tmp_path, optimizer):
    full = train_from_config(_config(tmp_path / "a", optimizer))
    trainer, _ = build_runtime(_config(tmp_path / "b", optimizer))
    assert isinstance(trainer.optimizer, CautiousOptimizer)
    if optimizer["name"] == "muon":
        assert isinstance(trainer.optimizer.base, HybridOptimizer)
    first = trainer.fit(2)
    trainer.logger.close()
    resumed = train_from_config(_config(tmp_path / "b", optimizer), resume=True)
    losses = [m["loss"] for m in first.metrics + resumed.metrics]
    assert losses == [m["loss"] for m in full.metrics]
    assert [m["lr"] for m in resumed.metrics] == [m["lr"] for m in full.metrics[2:]]
