"""2.0.0 constructor keywords keep working after the constructors were grouped (issue 30 item 4):
``HybridOptimizer(muon_momentum=...)``, ``HubClient(retry_initial=...)`` and
``Trainer(max_steps=..., start_step=..., precision=..., shape_report=...)`` map onto the grouped
settings, with a ``DeprecationWarning``; a keyword none knows is a ``TypeError``. A 2.0.0-style
coordinator (start/stop/state only) still drives a ``Trainer``."""

from __future__ import annotations

import io
import warnings

import pytest
import torch

from speedtronic.diloco.hub import HubClient
from speedtronic.metrics.logger import MetricLogger
from speedtronic.optim.muon import HybridOptimizer, MuonSettings
from speedtronic.train.precision import PrecisionPlan
from speedtronic.train.trainer import Trainer, TrainerOptions


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


class Regression(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).pow(2).mean()


def _linear_run() -> tuple[Regression, torch.optim.SGD, list[dict[str, torch.Tensor]]]:
    model = Regression()
    batches = [{"x": torch.randn(2, 4)} for _ in range(3)]
    return model, torch.optim.SGD(model.parameters(), lr=0.1), batches


def test_trainer_takes_the_2_0_0_keywords_as_trainer_options():
    fp32 = PrecisionPlan("fp32", torch.float32, False, False, "cpu")
    report = object()  # a ShapeReport stand-in: the trainer keeps it and skips its own check
    quiet = MetricLogger(stream=io.StringIO())
    with pytest.warns(DeprecationWarning, match=r"options=TrainerOptions\(max_steps=\.\.\."):
        old = Trainer(*_linear_run(), logger=quiet, max_steps=7, start_step=2, precision=fp32,
                      shape_report=report)  # fmt: skip
    options = TrainerOptions(max_steps=7, start_step=2, precision=fp32, shape_report=report)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new spelling does not warn
        new = Trainer(*_linear_run(), logger=quiet, options=options)
    for trainer in (old, new):
        assert (trainer.max_steps, trainer.step) == (7, 2)
        assert trainer.precision is fp32 and trainer.shape_report is report
    with pytest.raises(TypeError, match="max_step"):
        Trainer(*_linear_run(), logger=quiet, max_step=3)


class StartStopOnly:
    """A 2.0.0-style coordinator: start, stop and its state, nothing else."""

    def __init__(self) -> None:
        self.calls: list[object] = []

    def start(self) -> None:
        self.calls.append("start")

    def stop(self) -> None:
        self.calls.append("stop")

    def state_dict(self) -> dict[str, int]:
        return {"rounds": 4}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.calls.append(("load", state))


def test_a_2_0_0_style_coordinator_is_started_stopped_and_checkpointed():
    coordinator = StartStopOnly()
    quiet = MetricLogger(stream=io.StringIO())
    trainer = Trainer(*_linear_run(), logger=quiet, coordinator=coordinator,
                      options=TrainerOptions(max_steps=2))  # fmt: skip
    assert trainer.fit().steps == 2
    assert coordinator.calls == ["start", "stop"]
    state = trainer.state_dict()
    assert state["coordinator"] == {"rounds": 4}
    other = StartStopOnly()
    Trainer(*_linear_run(), logger=quiet, coordinator=other).resume(state)
    assert other.calls == [("load", {"rounds": 4})]
