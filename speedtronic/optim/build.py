"""Build the configured optimizer for a model: AdamW, hybrid Muon/AdamW, optionally cautious.

``optimizer.name: adamw`` trains every trainable parameter with AdamW (2.0.0 left hidden
matrices untrained; SPEC §3). ``optimizer.name: muon`` routes hidden 2-D ``nn.Linear`` weights to
Muon and the rest to AdamW (:func:`~speedtronic.optim.routing.route_parameters`). Either way every
trainable parameter is in exactly one group (asserted).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.optim import AdamW, Optimizer

from speedtronic.config import OptimizerConfig, SpeedtronicConfig
from speedtronic.optim.cautious import CautiousOptimizer
from speedtronic.optim.muon import HybridOptimizer, MuonSettings, adamw_or_unfused
from speedtronic.optim.routing import assert_exactly_once, route_parameters, trainable_parameters


def _optimizer_section(config: SpeedtronicConfig | OptimizerConfig) -> OptimizerConfig:
    """Accept a full ``SpeedtronicConfig`` or its ``optimizer`` section."""
    return config.optimizer if isinstance(config, SpeedtronicConfig) else config


def supports_fused_adamw(device: torch.device | str) -> bool:
    """Whether ``torch.optim.AdamW(fused=True)`` can be built on ``device`` (CUDA only)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        probe = nn.Parameter(torch.zeros(1, device=device))
        AdamW([probe], fused=True)
    except (TypeError, RuntimeError, ValueError, AssertionError):
        return False
    return True


def _fused_requested(section: OptimizerConfig, device: torch.device) -> bool:
    if section.cautious:
        return False
    if section.fused is not None:
        return section.fused
    return supports_fused_adamw(device)


def build_adamw(params: list[nn.Parameter], section: OptimizerConfig, *, fused: bool) -> AdamW:
    """``torch.optim.AdamW`` from the optimizer section; a failed fused build falls back."""
    return adamw_or_unfused(
        params,
        fused=fused,
        lr=section.lr,
        betas=section.betas,
        eps=section.eps,
        weight_decay=section.weight_decay,
    )


def build_optimizer(
    model: nn.Module, config: SpeedtronicConfig | OptimizerConfig, device: torch.device | str
) -> Optimizer:
    """The optimizer described by ``config.optimizer`` for ``model`` on ``device``.

    ``adamw`` -> ``torch.optim.AdamW`` over all unique trainable parameters; ``muon`` ->
    :class:`HybridOptimizer` (one base lr for both branches); ``cautious: true`` wraps the result
    in :class:`CautiousOptimizer` (fused AdamW off). ``fused: null`` probes CUDA support on
    ``device``. Raises ``ValueError("model has no trainable parameters")`` when there is nothing
    to train.
    """
    section = _optimizer_section(config)
    device = torch.device(device)
    trainable = trainable_parameters(model)
    if not trainable:
        raise ValueError("model has no trainable parameters")
    fused = _fused_requested(section, device)
    name = section.name
    optimizer: Optimizer
    if name == "adamw":
        optimizer = build_adamw(trainable, section, fused=fused)
    elif name == "muon":
        routing = route_parameters(model)
        muon, adamw = routing.muon_params, routing.adamw_params
        optimizer = HybridOptimizer(
            muon,
            adamw,
            muon_lr=section.lr,
            adamw_lr=section.lr,
            betas=section.betas,
            eps=section.eps,
            weight_decay=section.weight_decay,
            fused=fused and bool(adamw),
            muon=MuonSettings(
                momentum=section.muon_momentum,
                ns_steps=section.muon_ns_steps,
                norm_eps=section.muon_norm_eps,
                muon_plus=section.muon_plus,
                ns_dtype=section.muon_ns_dtype,
            ),
        )
    else:
        raise ValueError(f"optimizer.name must be 'adamw' or 'muon', got {name!r}")
    assert_exactly_once(model, [group["params"] for group in optimizer.param_groups])
    if section.cautious:
        optimizer = CautiousOptimizer(optimizer)
    return optimizer


# 2.0.0 name (``runtime.build_optimizer`` delegated to it).
build_v2_optimizer = build_optimizer
