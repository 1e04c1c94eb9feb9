"""LR schedule: warmup, cosine to min_lr_ratio, constant; horizon from scheduler.max_steps."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from speedtronic.config import SchedulerConfig, SpeedtronicConfig
from speedtronic.optim import LRSchedule, build_optimizer, build_scheduler


def _lrs(config: SpeedtronicConfig, steps: int) -> list[float]:
    model = nn.Linear(2, 2)
    optimizer = build_optimizer(model, config, "cpu")
    scheduler = build_scheduler(optimizer, config)
    lrs = [optimizer.param_groups[0]["lr"]]
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


def test_engine_worked_example():
    config = SpeedtronicConfig.from_dict(
        {"optimizer": {"lr": 3e-4}, "scheduler": {"warmup_steps": 1, "max_steps": 4}}
    )
    expected = [3e-4, 3e-4, 0.775 * 3e-4, 0.325 * 3e-4, 0.1 * 3e-4]
    assert _lrs(config, 4) == pytest.approx(expected)


def test_warmup_constant_and_clamping():
    schedule = LRSchedule(name="constant", warmup_steps=4, max_steps=10)
    assert [schedule(s) for s in range(6)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])
    cosine = LRSchedule(warmup_steps=0, max_steps=10, min_lr_ratio=0.0)
    assert cosine(0) == pytest.approx(1.0)
    assert cosine(10) == pytest.approx(0.0) and cosine(50) == pytest.approx(0.0)
    assert LRSchedule(warmup_steps=0, max_steps=0)(0) == pytest.approx(1.0)


def test_horizon_follows_the_run_target_and_hybrid_groups_share_it():
    config = SpeedtronicConfig.from_dict(
        {"optimizer": "muon", "run": {"max_steps": 7}, "scheduler": {"warmup_steps": 0}}
    )
    assert config.scheduler.max_steps == 7
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    optimizer = build_optimizer(model, config, "cpu")
    scheduler = build_scheduler(optimizer, config)
    for _ in range(7):
        optimizer.step()
        scheduler.step()
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.1 * 3e-4] * 2)


def test_scheduler_state_dict_round_trip():
    config = SpeedtronicConfig.from_dict({"scheduler": {"warmup_steps": 2, "max_steps": 6}})
    model = nn.Linear(2, 2)
    optimizer = build_optimizer(model, config, "cpu")
    scheduler = build_scheduler(optimizer, config)
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    state = scheduler.state_dict()
    other_opt = build_optimizer(model, config, "cpu")
    other = build_scheduler(other_opt, config)
    other.load_state_dict(state)
    assert other.last_epoch == 3
    assert other.get_last_lr() == pytest.approx(scheduler.get_last_lr())
    torch.save(state, __import__("io").BytesIO())  # picklable (no lambdas)


def test_unknown_schedule_name_is_rejected():
    with pytest.raises(ValueError, match=r"scheduler\.name"):
        build_scheduler(
            torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1),
            SchedulerConfig(name="linear", max_steps=10),
        )


def test_a_bare_section_schedules_with_its_own_horizon_or_says_what_is_missing():
    optimizer = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    section = SchedulerConfig(warmup_steps=0, max_steps=4, min_lr_ratio=0.0)
    assert build_scheduler(optimizer, section).lr_lambdas[0](4) == pytest.approx(0.0)
    with pytest.raises(ValueError, match=r"scheduler\.max_steps is unset"):
        build_scheduler(optimizer, SchedulerConfig())
