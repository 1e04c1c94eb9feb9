"""2.0.0 constructor keywords keep working after the constructors were grouped (issue 30 item 4):
``HybridOptimizer(muon_momentum=...)`` and ``HubClient(retry_initial=...)`` map onto the grouped
settings, with a ``DeprecationWarning``; a keyword neither knows is a ``TypeError``."""

from __future__ import annotations

import pytest
import torch

from speedtronic.diloco.hub import HubClient
from speedtronic.optim.muon import HybridOptimizer, MuonSettings


def _params() -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    return [torch.nn.Parameter(torch.randn(8, 8))], [torch.nn.Parameter(torch.randn(8))]


def test_hybrid_optimizer_takes_the_2_0_0_muon_keywords():
    muon, adamw = _params()
    with pytest.warns(DeprecationWarning, match="muon=MuonSettings"):
        old = HybridOptimizer(muon, adamw, muon_lr=0.02, adamw_lr=1e-3, muon_momentum=0.9,
                              muon_ns_steps=3, muon_norm_eps=1e-6, muon_plus=True)  # fmt: skip
    muon2, adamw2 = _params()
    settings = MuonSettings(momentum=0.9, ns_steps=3, norm_eps=1e-6, muon_plus=True)
    new = HybridOptimizer(muon2, adamw2, muon_lr=0.02, adamw_lr=1e-3, muon=settings)
    strip = lambda groups: [{k: v for k, v in g.items() if k != "params"} for g in groups]  # noqa: E731
    assert strip(old.param_groups) == strip(new.param_groups)
    assert old.param_groups[0]["momentum"] == 0.9 and old.param_groups[0]["ns_steps"] == 3
    with pytest.raises(TypeError, match="muon_mementum"):
        HybridOptimizer(*_params(), muon_lr=0.02, adamw_lr=1e-3, muon_mementum=0.9)


def test_hub_client_takes_the_2_0_0_retry_keywords(tmp_path):
    with pytest.warns(DeprecationWarning, match="retry=RetryPolicy"):
        client = HubClient("org/run", cache_dir=tmp_path, retry_initial=0.5, retry_max=4.0,
                           retry_attempts=3)  # fmt: skip
    assert (client.retry.initial, client.retry.maximum, client.retry.attempts) == (0.5, 4.0, 3)
    with pytest.raises(TypeError, match="retry_intial"):
        HubClient("org/run", cache_dir=tmp_path, retry_intial=0.5)
