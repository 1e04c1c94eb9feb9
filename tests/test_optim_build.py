"""Routing, optimizer building, the hybrid facade, cautious updates and state-dict round trips."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from speedtronic.config import SpeedtronicConfig
from speedtronic.model import ReferenceTransformer
from speedtronic.optim import (
    CautiousOptimizer,
    HybridOptimizer,
    Muon,
    build_optimizer,
    build_scheduler,
    cautious_mask,
    route_parameters,
)


def _reference(**overrides) -> ReferenceTransformer:
    kwargs = dict(vocab_size=32, block_size=8, n_layer=1, n_head=4, n_kv_head=2, d_model=32)
    kwargs.update(d_ff=64, **overrides)
    return ReferenceTransformer(**kwargs)


def _config(**optimizer) -> SpeedtronicConfig:
    return SpeedtronicConfig.from_dict({"optimizer": optimizer, "run": {"max_steps": 4}})


def _loss(model: nn.Module, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 32, (2, 8), generator=generator)
    return model(ids, labels=ids)["loss"]


def test_reference_routing_is_role_aware_and_tied_safe():
    model = _reference()
    routing = route_parameters(model)
    assert len(routing.muon) == 7 and len(routing.adamw) == 4 and not routing.skipped
    assert all(param.ndim == 2 for param in routing.muon_params)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert sum(p is model.lm_head.weight for p in routing.adamw_params) == 1
    assert {name.split(".")[-2] for name, _ in routing.muon} == {
        "q_proj", "k_proj", "v_proj", "out_proj", "gate_proj", "up_proj", "down_proj"
    }  # fmt: skip


def test_routing_counts_scale_with_layers_and_untied_head():
    routing = route_parameters(_reference(n_layer=3, tie_weights=False))
    assert len(routing.muon) == 21 and len(routing.adamw) == 3 + 2 * 3
    assert "lm_head.weight" in [name for name, _ in routing.adamw]


def test_routing_roles_frozen_and_custom_matrices():
    class Custom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.matrix = nn.Parameter(torch.randn(3, 2))  # not an nn.Linear -> AdamW
            self.proj = nn.Linear(4, 4)
            self.frozen = nn.Linear(4, 4, bias=False)
            self.frozen.weight.requires_grad_(False)
            self.forced = nn.Linear(4, 4)
            self.forced._speedtronic_optimizer_role = "adamw"
            self.output = nn.Linear(4, 2, bias=False)  # head name -> AdamW

    model = Custom()
    routing = route_parameters(model)
    assert [n for n, _ in routing.muon] == ["proj.weight"]
    assert {n for n, _ in routing.adamw} == {
        "matrix", "proj.bias", "forced.weight", "forced.bias", "output.weight"
    }  # fmt: skip
    assert [n for n, _ in routing.skipped] == ["frozen.weight"]
    model.matrix_owner = nn.Module()
    model.proj._speedtronic_optimizer_role = "sgd"
    with pytest.raises(ValueError, match="sgd"):
        route_parameters(model)


def test_adamw_trains_every_parameter_including_hidden_matrices():
    model = _reference()
    optimizer = build_optimizer(model, _config(name="adamw"), "cpu")
    assert type(optimizer) is torch.optim.AdamW
    params = [p for group in optimizer.param_groups for p in group["params"]]
    assert len(params) == len({id(p) for p in model.parameters()}) == 11
    q_proj = model.transformer.h[0].attn.q_proj.weight
    before = q_proj.detach().clone()
    _loss(model).backward()
    optimizer.step()
    assert not torch.equal(before, q_proj)


def test_muon_builds_hybrid_with_one_lr_schedule():
    model = _reference()
    config = _config(name="muon", muon_plus=True, lr=1e-3)
    optimizer = build_optimizer(model, config, "cpu")
    assert isinstance(optimizer, HybridOptimizer)
    assert [g["algorithm"] for g in optimizer.param_groups] == ["muon", "adamw"]
    assert optimizer.param_groups[1]["fused"] is False
    scheduler = build_scheduler(optimizer, config)
    _loss(model).backward()
    optimizer.step()
    scheduler.step()
    assert len(optimizer.state) == 11
    expected_lr = 1e-3 * scheduler.lr_lambdas[0](1)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([expected_lr] * 2)
    assert optimizer.muon.param_groups[0]["muon_plus"] is True


def test_cautious_wraps_either_optimizer_and_turns_fused_off():
    for name in ("adamw", "muon"):
        optimizer = build_optimizer(
            _reference(), _config(name=name, cautious=True, fused=True), "cpu"
        )
        assert isinstance(optimizer, CautiousOptimizer)
        groups = optimizer.param_groups
        assert all(not g.get("fused") for g in groups)
        assert set(optimizer.state_dict()) == {"state", "param_groups"}


def test_no_trainable_parameters_is_a_value_error():
    model = nn.Linear(2, 2)
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="model has no trainable parameters"):
        build_optimizer(model, _config(), "cpu")


def test_all_linear_model_gets_a_non_empty_optimizer():
    optimizer = build_optimizer(nn.Linear(4, 3, bias=False), _config(), "cpu")
    assert sum(len(g["params"]) for g in optimizer.param_groups) == 1
    hybrid = build_optimizer(nn.Linear(4, 3, bias=False), _config(name="muon"), "cpu")
    assert [g["algorithm"] for g in hybrid.param_groups] == ["muon"]


def test_hybrid_closure_runs_exactly_once():
    model = nn.Linear(2, 2)
    optimizer = build_optimizer(model, _config(name="muon"), "cpu")
    calls = []

    def closure():
        calls.append(1)
        optimizer.zero_grad()
        loss = model(torch.ones(1, 2)).sum()
        loss.backward()
        return loss

    assert optimizer.step(closure) is not None
    assert calls == [1]
    cautious = CautiousOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1))
    cautious.step(closure)
    assert calls == [1, 1]


def test_hybrid_rejects_empty_and_state_clear_covers_both_branches():
    with pytest.raises(ValueError):
        HybridOptimizer([], [], muon_lr=1e-3, adamw_lr=1e-3)
    model = _reference()
    optimizer = build_optimizer(model, _config(name="muon"), "cpu")
    _loss(model).backward()
    optimizer.step()
    optimizer.state.clear()
    assert len(optimizer.muon.state) == 0 and len(optimizer.adamw.state) == 0


def test_cautious_mask_keeps_agreeing_coordinates_and_rescales():
    update = torch.tensor([1.0, -2.0, 3.0, 0.5])
    grad = torch.tensor([2.0, 1.0, 1.0, -1.0])
    mask = cautious_mask(update, grad)
    kept = torch.tensor([1.0, 0.0, 1.0, 0.0])
    assert torch.allclose(mask, kept * 4 / (2 + 1))


def test_cautious_step_masks_the_update_and_keeps_decay():
    param = nn.Parameter(torch.tensor([1.0, 1.0, 1.0, 1.0]))
    base = torch.optim.SGD([param], lr=0.1, weight_decay=0.0)
    optimizer = CautiousOptimizer(base)
    param.grad = torch.tensor([1.0, -1.0, 2.0, 0.0])
    optimizer.step()
    # SGD update u = lr·g; g·u > 0 except where g == 0 -> kept 3 of 4, scale 4/(3+1) = 1.
    assert torch.allclose(param.detach(), torch.tensor([0.9, 1.1, 0.8, 1.0]))
    # AdamW: decay applied unmasked, update of masked coordinates dropped.
    weight = nn.Parameter(torch.ones(2))
    adamw = CautiousOptimizer(torch.optim.AdamW([weight], lr=0.1, weight_decay=0.5))
    weight.grad = torch.tensor([1.0, 0.0])
    adamw.step()
    decayed = 1.0 * (1 - 0.1 * 0.5)
    assert weight[1].item() == pytest.approx(decayed)
    assert weight[0].item() == pytest.approx(decayed - 0.1 * 2 / 2, rel=1e-4)  # scale 2/(1+1)


def _train(model, optimizer, steps, start=0):
    losses = []
    for step in range(start, start + steps):
        optimizer.zero_grad(set_to_none=True)
        loss = _loss(model, seed=step)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


VARIANTS = [
    {"name": "adamw"},
    {"name": "adamw", "cautious": True},
    {"name": "muon"},
    {"name": "muon", "muon_plus": True},
    {"name": "muon", "cautious": True},
    {"name": "muon", "muon_plus": True, "cautious": True},
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(f"{k}={v[k]}" for k in v))
def test_state_dict_round_trip_continues_identically(variant):
    torch.manual_seed(0)
    config = _config(lr=1e-2, **variant)
    model = _reference()
    optimizer = build_optimizer(model, config, "cpu")
    _train(model, optimizer, 2)
    saved_model = copy.deepcopy(model.state_dict())
    saved = copy.deepcopy(optimizer.state_dict())
    assert set(saved) == {"state", "param_groups"}
    expected = _train(model, optimizer, 2, start=2)

    resumed = _reference()
    resumed.load_state_dict(saved_model)
    fresh = build_optimizer(resumed, config, "cpu")
    fresh.load_state_dict(saved)
    assert _train(resumed, fresh, 2, start=2) == expected
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_muon_state_dict_survives_torch_save_weights_only(tmp_path):
    param = nn.Parameter(torch.randn(4, 3))
    param.grad = torch.randn(4, 3)
    optimizer = Muon([param], lr=0.01)
    optimizer.step()
    path = tmp_path / "opt.pt"
    torch.save(optimizer.state_dict(), path)
    loaded = torch.load(path, weights_only=True)
    other = Muon([nn.Parameter(param.detach().clone())], lr=0.01)
    other.load_state_dict(loaded)
    assert other.state_dict()["state"][0]["step"] == 1


@pytest.mark.parametrize(
    "bad",
    [
        {"optimizer": {"name": "adamw", "muon_plus": True}},
        {"optimizer": {"name": "muon", "cautious": False}, "cautious": True},
        {"ooo_streams": 0},
        {"ooo_streams": 9},
    ],
)
def test_bad_optimizer_and_systems_config_is_a_config_error(bad):
    from speedtronic.config import ConfigError

    with pytest.raises(ConfigError):
        SpeedtronicConfig.from_dict(bad)


def test_scalar_optimizer_and_root_flags_build_a_cautious_hybrid():
    config = SpeedtronicConfig.from_dict({"optimizer": "muon", "muon_plus": True, "cautious": True})
    optimizer = build_optimizer(_reference(), config, "cpu")
    assert isinstance(optimizer, CautiousOptimizer) and isinstance(optimizer.base, HybridOptimizer)
    assert optimizer.base.muon.param_groups[0]["muon_plus"] is True


def test_cautious_wrapper_matches_the_pure_function():
    from speedtronic.optim import cautious_step

    torch.manual_seed(6)
    start, grad = torch.randn(5, 4), torch.randn(5, 4)
    plain = nn.Parameter(start.clone())
    plain.grad = grad.clone()
    torch.optim.AdamW([plain], lr=0.05, weight_decay=0.2).step()
    expected = cautious_step(start, plain.detach(), grad, lr=0.05, weight_decay=0.2)
    wrapped = nn.Parameter(start.clone())
    wrapped.grad = grad.clone()
    CautiousOptimizer(torch.optim.AdamW([wrapped], lr=0.05, weight_decay=0.2)).step()
    torch.testing.assert_close(wrapped.detach(), expected)
