"""Newton–Schulz, Muon+, the Muon optimizer and its error cases."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from speedtronic.optim import Muon, muon_update, newton_schulz, post_polar_normalize, shape_scale


def test_newton_schulz_is_pure_finite_and_shape_preserving():
    torch.manual_seed(0)
    matrix = torch.randn(5, 3)
    before = matrix.clone()
    result = newton_schulz(matrix)
    assert result.shape == (5, 3)
    assert torch.isfinite(result).all()
    assert torch.equal(matrix, before)
    zeros = newton_schulz(torch.zeros(3, 4))
    assert torch.isfinite(zeros).all() and torch.count_nonzero(zeros) == 0


@pytest.mark.parametrize("shape", [(3, 8), (8, 3), (1, 5), (5, 1), (16, 16), (32, 12)])
def test_newton_schulz_handles_rectangular_matrices(shape):
    torch.manual_seed(1)
    result = newton_schulz(torch.randn(*shape), steps=4)
    assert result.shape == shape
    assert torch.isfinite(result).all()


@pytest.mark.parametrize("shape", [(16, 16), (24, 64), (64, 24)])
def test_newton_schulz_result_is_nearly_orthogonal(shape):
    """Singular values land in Keller Jordan's band around 1 (not exactly 1)."""
    torch.manual_seed(2)
    matrix = torch.randn(*shape)
    result = newton_schulz(matrix, steps=5)
    singular = torch.linalg.svdvals(result)
    assert singular.min() > 0.6 and singular.max() < 1.25
    # Same singular vectors as the exact polar factor U Vᵀ: close in relative Frobenius norm.
    u, _, vh = torch.linalg.svd(matrix, full_matrices=False)
    polar = u @ vh
    assert (result - polar).norm() / polar.norm() < 0.35
    # More iterations do not blow up.
    assert torch.isfinite(newton_schulz(matrix, steps=20)).all()


def test_newton_schulz_dtypes_and_validation():
    assert newton_schulz(torch.randn(4, 4, dtype=torch.float64)).dtype == torch.float64
    assert newton_schulz(torch.randn(4, 4, dtype=torch.bfloat16)).dtype == torch.float32  # CPU
    with pytest.raises(ValueError):
        newton_schulz(torch.randn(4))
    with pytest.raises(TypeError):
        newton_schulz(torch.ones(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError):
        newton_schulz(torch.randn(2, 2), steps=0)
    with pytest.raises(ValueError):
        newton_schulz(torch.randn(2, 2), eps=0.0)


def test_post_polar_normalize_row_col_gives_unit_columns():
    torch.manual_seed(3)
    update = torch.randn(4, 3) * 10
    before = update.clone()
    result = post_polar_normalize(update, mode="row_col")
    assert torch.allclose(result.norm(dim=0), torch.ones(3), atol=1e-4)
    assert torch.equal(update, before)
    rows = post_polar_normalize(update, mode="row")
    assert torch.allclose(rows.norm(dim=1), torch.ones(4), atol=1e-4)
    col_row = post_polar_normalize(update, mode="col_row")  # columns, then rows
    assert torch.allclose(col_row.norm(dim=1), torch.ones(4), atol=1e-4)
    assert torch.equal(post_polar_normalize(update, mode="none"), update)
    half = post_polar_normalize(update.bfloat16())
    assert half.dtype == torch.bfloat16
    for bad in ({"mode": "diag"}, {"eps": 0.0}):
        with pytest.raises(ValueError):
            post_polar_normalize(update, **bad)
    with pytest.raises(ValueError):
        post_polar_normalize(torch.randn(3))


def test_muon_update_matches_the_formula_and_keeps_grad():
    torch.manual_seed(4)
    grad = torch.randn(8, 4)
    grad_before = grad.clone()
    buffer = torch.zeros(8, 4)
    update = muon_update(grad, buffer, momentum=0.9, ns_steps=5)
    assert torch.equal(grad, grad_before)
    expected_buffer = 0.1 * grad
    assert torch.allclose(buffer, expected_buffer)
    direction = 0.1 * grad + 0.9 * expected_buffer
    expected = newton_schulz(direction) * math.sqrt(8 / 4)
    assert torch.allclose(update, expected, atol=1e-5)
    assert shape_scale((4, 8)) == 1.0


def _matrix_param(shape=(6, 4), seed=5):
    generator = torch.Generator().manual_seed(seed)
    param = nn.Parameter(torch.randn(*shape, generator=generator))
    param.grad = torch.randn(*shape, generator=generator)
    return param


def test_muon_step_applies_decoupled_decay_and_scaled_update():
    param = _matrix_param()
    start, grad = param.detach().clone(), param.grad.clone()
    # fp32 on every machine: the reference below is fp32, ``auto`` may pick bf16 on this CPU.
    optimizer = Muon([param], lr=0.01, momentum=0.95, weight_decay=0.1, ns_dtype="fp32")
    optimizer.step()
    reference = muon_update(grad, torch.zeros(6, 4), momentum=0.95)
    expected = start * (1 - 0.01 * 0.1) - 0.01 * reference
    assert torch.allclose(param.detach(), expected, atol=1e-6)
    state = optimizer.state[param]
    assert state["momentum_buffer"].dtype == torch.float32 and state["step"] == 1


def test_muon_batched_equal_shapes_match_single_updates():
    params = [_matrix_param(seed=s) for s in range(3)]
    singles = [_matrix_param(seed=s) for s in range(3)]
    Muon(params, lr=0.02, weight_decay=0.1).step()
    for single in singles:
        Muon([single], lr=0.02, weight_decay=0.1).step()
    for batched, single in zip(params, singles, strict=True):
        assert torch.allclose(batched, single, atol=1e-6)


def test_muon_muon_plus_changes_the_update():
    plain, plus = _matrix_param(), _matrix_param()
    Muon([plain], lr=0.01).step()
    Muon([plus], lr=0.01, muon_plus=True).step()
    assert not torch.allclose(plain, plus)


def test_muon_rejects_bad_parameters_at_step():
    vector = nn.Parameter(torch.randn(4))
    vector.grad = torch.randn(4)
    optimizer = Muon([vector])  # accepted at construction
    with pytest.raises(ValueError):
        optimizer.step()
    matrix = nn.Parameter(torch.randn(3, 3))
    matrix.grad = torch.randn(3, 3).to_sparse()
    with pytest.raises(RuntimeError):
        Muon([matrix]).step()
    with pytest.raises(ValueError):
        Muon([matrix], lr=0.0)
    with pytest.raises(ValueError):
        Muon([matrix], momentum=1.0)


def test_muon_closure_runs_once_and_params_without_grad_are_skipped():
    param, idle = _matrix_param(), nn.Parameter(torch.randn(3, 3))
    before = idle.detach().clone()
    calls = []
    optimizer = Muon([param, idle], lr=0.01)
    assert optimizer.step(lambda: calls.append(1) or 1.5) == 1.5
    assert calls == [1]
    assert torch.equal(idle, before) and idle not in optimizer.state


def test_muon_momentum_stays_fp32_for_bf16_parameters_after_load():
    param = nn.Parameter(torch.randn(4, 3).bfloat16())
    param.grad = torch.randn(4, 3).bfloat16()
    optimizer = Muon([param], lr=0.01)
    optimizer.step()
    assert optimizer.state[param]["momentum_buffer"].dtype == torch.float32
    other_param = nn.Parameter(param.detach().clone())
    other = Muon([other_param], lr=0.01)
    other.load_state_dict(optimizer.state_dict())  # torch casts state to the param dtype
    other_param.grad = param.grad.clone()
    other.step()
    assert other.state[other_param]["momentum_buffer"].dtype == torch.float32
    assert param.dtype == torch.bfloat16 and torch.isfinite(other_param.float()).all()
