"""Issue 33's outer-step arithmetic (speedtronic/diloco/master.py, node.py), its settings, and the
ideal run that computes it (speedtronic.testing.diloco_ideal.simulate)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from speedtronic.config import ConfigError, DistributedConfig, SpeedtronicConfig
from speedtronic.diloco.exchange import syncs_momentum
from speedtronic.diloco.master import (
    NormTally,
    adaptive_eta,
    average_states,
    squared_norm,
)
from speedtronic.diloco.node import first_moments, install_first_moments
from speedtronic.testing.diloco_ideal import RecentGlobals, simulate

ROOT = Path(__file__).resolve().parents[1]


def _eta(deltas: list[dict[str, torch.Tensor]], c: float = 0.75, cap: float = 2.0) -> float:
    """eta of a round, as the master computes it: a tally of the contributions it reads,
    then the squared norm of their mean."""
    tally = NormTally()
    for delta in deltas:
        for value in delta.values():
            tally.add(value)
        tally.close()
    mean = average_states(deltas)
    return adaptive_eta(tally.spread, squared_norm(mean), tally.count, c, cap)


def test_identical_contributions_step_with_eta_one():
    delta = {"w": torch.randn(8, 4), "b": torch.randn(4)}
    assert _eta([delta] * 4) == 1.0
    assert _eta([delta] * 4, c=1.5) == 1.5  # c > 1 extrapolates even when the nodes agree


def test_orthogonal_contributions_of_equal_norm_give_c_times_k_up_to_the_cap():
    deltas = [{"w": torch.eye(4)[i] * 3.0} for i in range(4)]  # K = 4, orthogonal, norm 3
    assert _eta(deltas, c=0.75, cap=2.0) == 2.0  # 0.75 * 4 = 3, capped
    assert _eta(deltas, c=0.75, cap=10.0) == 3.0
    assert _eta(deltas, c=0.4, cap=10.0) == pytest.approx(1.6)
    assert _eta(deltas[:2], c=0.75, cap=10.0) == pytest.approx(1.5)  # K = 2: c * 2


def test_degenerate_rounds_step_with_eta_one():
    one = {"w": torch.tensor([1.0, -2.0])}
    assert _eta([one], c=5.0) == 1.0  # one contribution: no spread to measure
    opposite = [one, {"w": -one["w"]}]
    assert _eta(opposite, c=5.0) == 1.0  # the mean is zero: nothing to extrapolate
    assert adaptive_eta(0.0, 0.0, 4, 0.75, 2.0) == 1.0
    assert adaptive_eta(float("inf"), 1.0, 4, 0.75, 2.0) == 1.0


def test_eta_streamed_slice_by_slice_equals_eta_from_whole_tensors():
    torch.manual_seed(0)
    deltas = [
        {"a": torch.randn(300, 7) + i * 0.1, "b": torch.randn(1000) * (i + 1)} for i in range(3)
    ]
    whole = _eta(deltas, c=1.3, cap=10.0)
    streamed = NormTally()
    for delta in deltas:  # the master reads a file in chunks of any size, keys in any order
        for key in ("b", "a"):
            for part in delta[key].reshape(-1).split(97):
                streamed.add(part)
        streamed.close()
    total = {k: sum(d[k] for d in deltas) / 3 for k in deltas[0]}
    assert squared_norm(total, chunk=13) == pytest.approx(squared_norm(total), rel=1e-12)
    eta = adaptive_eta(streamed.spread, squared_norm(total, chunk=13), streamed.count, 1.3, 10.0)
    assert eta == whole and 1.0 < eta < 10.0
    # the weighted form: a contribution of weight 2 counts as two identical ones
    twice = NormTally()
    twice.add(deltas[0]["a"], 2.0)
    twice.close(2.0)
    single = NormTally()
    for _ in range(2):
        single.add(deltas[0]["a"])
        single.close()
    assert twice.spread == pytest.approx(single.spread) and twice.weight == single.weight


def test_the_final_model_is_the_mean_of_the_last_n_globals():
    globals_ = [{"w": torch.full((3,), float(i)), "n": torch.tensor(i)} for i in range(4)]
    recent = RecentGlobals(2)
    recent.push(globals_[0])
    assert torch.equal(recent.final()["w"], globals_[0]["w"])  # fewer globals than N
    for state in globals_[1:]:
        recent.push(state)
    final = recent.final()
    assert torch.equal(final["w"], torch.full((3,), 2.5)) and final["n"].item() == 3
    three = RecentGlobals(3)
    for state in globals_:
        three.push(state)
    assert torch.equal(three.final()["w"], torch.full((3,), 2.0))
    last = RecentGlobals(1)
    for state in globals_:
        last.push(state)
    assert torch.equal(last.final()["w"], globals_[-1]["w"])
    half = average_states([{"w": torch.ones(2, dtype=torch.bfloat16)}] * 2)
    assert half["w"].dtype == torch.bfloat16
    with pytest.raises(ValueError):
        RecentGlobals(0)


def test_averaged_first_moments_are_installed_on_every_node():
    models, optimizers = [], []
    for seed in range(3):
        torch.manual_seed(seed)
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(torch.randn(5, 4)).square().sum().backward()
        optimizer.step()
        models.append(model)
        optimizers.append(optimizer)
    moments = [first_moments(m, o) for m, o in zip(models, optimizers, strict=True)]
    assert set(moments[0]) == {"weight", "bias"}
    mean = average_states(moments)
    for model, optimizer in zip(models, optimizers, strict=True):
        assert install_first_moments(model, optimizer, mean) == 2
        assert torch.equal(optimizer.state[model.weight]["exp_avg"], mean["weight"])
    untouched = torch.optim.AdamW(torch.nn.Linear(4, 2).parameters())  # no step: no moment
    assert install_first_moments(torch.nn.Linear(4, 2), untouched, mean) == 0
    assert [syncs_momentum("every_n", 3, r) for r in range(1, 7)] == [0, 0, 1, 0, 0, 1]
    assert all(syncs_momentum("every_round", 3, r) for r in range(1, 4))
    assert not any(syncs_momentum("off", 1, r) for r in range(1, 4))


# -------------------------------------------------------------------------- the settings
def test_a_2_0_0_config_with_outer_lr_or_momentum_keeps_nesterov():
    section = SpeedtronicConfig.from_dict({"distributed": {"outer_momentum": 0.5}}).distributed
    assert (section.outer_step, section.outer_lr, section.outer_momentum) == ("nesterov", 0.7, 0.5)
    section = DistributedConfig(outer_lr=0.3)
    assert (section.outer_step, section.outer_lr, section.outer_momentum) == ("nesterov", 0.3, 0.9)
    section = DistributedConfig(outer_step="nesterov")
    assert (section.outer_lr, section.outer_momentum) == (0.7, 0.9)
    # and its final model is its last global, as in 2.0.0 (no final average)
    for section in (DistributedConfig(outer_lr=0.3), DistributedConfig(outer_step="nesterov")):
        assert section.final_average == 1


def test_the_default_is_adaptive_with_a_final_average_and_a_saved_config_reads_back_the_same():
    for data in ({}, {"distributed": {"outer_step": "Adaptive", "outer_lr": "1.0"}}):
        config = SpeedtronicConfig.from_dict(data)
        again = SpeedtronicConfig.from_dict(config.to_dict())
        assert again.distributed == config.distributed
        assert (config.distributed.outer_lr, config.distributed.outer_momentum) == (1.0, 0.0)
        assert (config.distributed.outer_step, config.distributed.final_average) == ("adaptive", 2)
    assert (DistributedConfig().outer_step, DistributedConfig().final_average) == ("adaptive", 2)
    # plain averaging, asked for, keeps its last global; a final average set is kept
    assert DistributedConfig(outer_step="average").final_average == 1
    assert DistributedConfig(outer_step="average", final_average=3).final_average == 3
    assert DistributedConfig(final_average=1).outer_step == "adaptive"
    assert DistributedConfig(sync_inner_momentum=False).sync_inner_momentum == "off"
    for name in ("configs/diloco.yaml", "speedtronic/defaults/diloco.yaml", "configs/hub.yaml"):
        shipped = SpeedtronicConfig.from_yaml(ROOT / name).distributed
        assert (shipped.outer_step, shipped.final_average) == ("adaptive", 2), name


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"outer_step": "average", "outer_momentum": 0.9}, "distributed.outer_momentum"),
        ({"outer_step": "adaptive", "outer_lr": 0.7}, "distributed.outer_lr"),
    ],
)
def test_a_conflicting_outer_step_names_both_fields(values, field):
    with pytest.raises(ConfigError) as error:
        SpeedtronicConfig.from_dict({"distributed": values})
    assert "distributed.outer_step" in str(error.value) and field in str(error.value)


# -------------------------------------------------------------------------- the ideal run
def _tiny() -> SpeedtronicConfig:
    return SpeedtronicConfig.from_dict(
        {
            "run": {"seed": 3, "device": "cpu", "max_steps": 6},
            "model": {"vocab_size": 64, "max_seq_len": 16, "n_layer": 1, "n_head": 2,
                      "d_model": 32},
            "data": {"synthetic": "markov", "num_tokens": 512, "micro_batch_size": 4,
                     "target_batch_size": 4},
            "optimizer": {"name": "adamw", "lr": 3e-3},
            "scheduler": {"warmup_steps": 1},
            "distributed": {"inner_steps": 2},
        }
    )  # fmt: skip


def test_the_ideal_run_reports_eta_and_a_small_c_is_plain_averaging():
    torch.set_num_threads(1)
    config, nodes = _tiny(), ["a", "b"]
    average = simulate(config, nodes, outer_step="average")
    assert average.etas == [1.0, 1.0, 1.0] and average.momentum_syncs == 0
    quiet = simulate(config, nodes, outer_step="adaptive", adaptive_c=0.01, final_average=1)
    assert quiet.etas == [1.0, 1.0, 1.0]  # c x ratio < 1: eta 1, the same arithmetic
    for key, value in average.global_state.items():
        assert torch.equal(quiet.global_state[key], value), key
    # mean |d|^2 >= |mean d|^2 always, so c >= cap steps with the cap in every round
    bold = simulate(
        config,
        nodes,
        outer_step="adaptive",
        adaptive_c=4.0,
        adaptive_max=1.5,
        delta_dtype="int8",
        sync_inner_momentum="every_n",
        inner_momentum_every=2,
        final_average=2,
    )
    assert bold.etas == [1.5, 1.5, 1.5] and bold.momentum_syncs == 1
    assert any(not torch.equal(bold.global_state[k], v) for k, v in average.global_state.items())
