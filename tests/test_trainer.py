"""Trainer loop: accumulation golden, loss resolution, skips, non-finite loss, stop, coordinator."""

from __future__ import annotations

import copy
import io
import threading

import pytest
import torch
from torch import nn

from speedtronic.checkpoint import CheckpointManager
from speedtronic.metrics.logger import MetricLogger
from speedtronic.train.forward import MissingLossError
from speedtronic.train.precision import PrecisionPlan
from speedtronic.train.trainer import (
    GradientOverflowError,
    NonFiniteLossError,
    Trainer,
    TrainerOptions,
    TrainResult,
)


class Scalar(nn.Module):
    """loss = (p - b)^2 for a batch value b."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.zeros(()))

    def forward(self, inputs, labels):
        return ((self.p - inputs.float().mean()) ** 2).reshape(())


def quiet_logger(**kwargs) -> MetricLogger:
    return MetricLogger(stream=io.StringIO(), **kwargs)


def events_of(logger: MetricLogger) -> list[tuple[str, dict]]:
    seen: list[tuple[str, dict]] = []
    logger.hooks.append(lambda event, payload: seen.append((event, dict(payload))))
    return seen


def sgd_trainer(model: nn.Module, batches, *, lr: float = 0.1, **keywords) -> Trainer:
    """A `Trainer` of ``model`` on ``batches`` with plain SGD at ``lr`` and a quiet logger
    (unless ``keywords`` name another); ``keywords`` go to the Trainer as they are."""
    keywords.setdefault("logger", quiet_logger())
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=lr), batches, **keywords)


def scalar_batches(*values: float):
    return [(torch.tensor([v]), torch.tensor([0.0])) for v in values]


def test_accumulation_golden_sgd():
    model = Scalar()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = Trainer(
        model,
        optimizer,
        scalar_batches(0.0, 2.0),
        logger=quiet_logger(),
        options=TrainerOptions(max_steps=1, accumulation_steps=2),
    )
    result = trainer.fit()
    # micro-batch losses 0 and 4: mean 2.0; grads 0 and -4 averaged -> -2; p = 0 + 0.1*2
    assert result.final_loss == 2.0
    assert model.p.item() == pytest.approx(0.2, abs=1e-7)
    assert torch.equal(model.p.detach(), torch.tensor(0.2))
    assert result.steps == 1 and result.samples == 2 and result.tokens == 2
    assert result.metrics[0]["micro_batches"] == 2


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 16, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids, labels=None, attention_mask=None):
        return {"logits": self.head(self.embed(input_ids))}


def lm_batches(n: int = 8, vocab: int = 16, seq: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(vocab, (2, seq + 1), generator=g)
        # a learnable pattern: next token = (token + 1) % vocab
        ids[:, 1:] = (ids[:, :1] + torch.arange(1, seq + 1)) % vocab
        out.append({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
    return out


def test_loss_decreases_and_metrics_keys():
    torch.manual_seed(0)
    model = TinyLM()
    trainer = Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=0.05),
        lm_batches(),
        logger=quiet_logger(),
        options=TrainerOptions(max_steps=40),
    )
    result = trainer.fit()
    assert isinstance(result, TrainResult)
    assert result.steps == 40 and len(result.metrics) == 40
    assert result.metrics[-1]["loss"] < 0.5 * result.metrics[0]["loss"]
    first = result.metrics[0]
    for key in (
        "step",
        "loss",
        "lr",
        "grad_norm",
        "steps_per_sec",
        "samples_per_sec",
        "tokens_per_sec",
        "samples",
        "tokens",
        "micro_batches",
        "step_time_s",
    ):
        assert key in first
    assert first["tokens"] == 12 and first["samples"] == 2
    assert first["grad_norm"] > 0


def test_attention_mask_counts_tokens():
    model = TinyLM()
    batch = lm_batches(1)[0]
    batch["attention_mask"] = torch.tensor(
        [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool
    )
    trainer = sgd_trainer(model, [batch], options=TrainerOptions(max_steps=2))
    assert trainer.fit().tokens == 18


def test_absolute_target_and_second_fit():
    model = TinyLM()
    trainer = sgd_trainer(model, lm_batches(), options=TrainerOptions(max_steps=3))
    assert trainer.fit().steps == 3
    again = trainer.fit()
    assert again.steps == 3 and again.final_loss is None and again.metrics == []
    assert trainer.fit(5).steps == 5
    with pytest.raises(ValueError, match="max_steps must be positive"):
        trainer.fit(0)


@pytest.mark.parametrize(
    "output",
    [
        lambda loss, logits: loss,
        lambda loss, logits: {"loss": loss, "aux": 1},
        lambda loss, logits: (loss, logits),
        lambda loss, logits: {"logits": logits},
    ],
)
def test_loss_resolution_forms(output):
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = TinyLM()

        def forward(self, input_ids, labels=None, attention_mask=None):
            logits = self.inner(input_ids)["logits"]
            loss = nn.functional.cross_entropy(logits.reshape(-1, 16), labels.reshape(-1))
            return output(loss, logits)

    model = Model()
    trainer = sgd_trainer(model, lm_batches(2), options=TrainerOptions(max_steps=2))
    assert trainer.fit().final_loss > 0


def test_model_without_loss_is_a_clear_error_before_any_update():
    class NoLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Linear(2, 2)

        def forward(self, inputs, labels):
            return {"hidden": self.w(inputs)}

    model = NoLoss()
    before = model.w.weight.detach().clone()
    batches = [(torch.ones(1, 2), torch.zeros(1, 2))]
    trainer = sgd_trainer(model, batches, options=TrainerOptions(max_steps=2))
    with pytest.raises(MissingLossError, match="NoLoss"):
        trainer.fit()
    assert torch.equal(model.w.weight, before)


class InfGrad(torch.autograd.Function):
    """Forward passes the loss through; backward returns inf for the first ``budget`` calls."""

    calls = 0
    budget = 0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        InfGrad.calls += 1
        if InfGrad.calls <= InfGrad.budget:
            return grad * float("inf")
        return grad


class Overflowing(Scalar):
    def forward(self, inputs, labels):
        return InfGrad.apply(super().forward(inputs, labels))


def cpu_fp16_plan() -> PrecisionPlan:
    return PrecisionPlan(
        "fp16", torch.float16, use_scaler=True, autocast_enabled=False, device_type="cpu"
    )


def test_grad_scaler_overflow_skips_then_recovers():
    InfGrad.calls, InfGrad.budget = 0, 2
    model = Overflowing()
    logger = quiet_logger()
    seen = events_of(logger)
    trainer = sgd_trainer(
        model,
        scalar_batches(1.0),
        logger=logger,
        options=TrainerOptions(precision=cpu_fp16_plan(), max_steps=3),
    )
    result = trainer.fit()
    assert result.steps == 3 and result.skipped_updates == 2
    skipped = [p for e, p in seen if e == "optimizer_step_skipped"]
    assert skipped == [
        {"step": 1, "reason": "grad_scaler_overflow", "elapsed_s": skipped[0]["elapsed_s"]},
        {"step": 1, "reason": "grad_scaler_overflow", "elapsed_s": skipped[1]["elapsed_s"]},
    ]
    assert [p["step"] for e, p in seen if e == "train_step"] == [1, 2, 3]


def test_twenty_consecutive_overflows_raise():
    InfGrad.calls, InfGrad.budget = 0, 10_000
    model = Overflowing()
    trainer = sgd_trainer(
        model,
        scalar_batches(1.0),
        options=TrainerOptions(precision=cpu_fp16_plan(), max_steps=3),
    )
    with pytest.raises(GradientOverflowError, match="20 consecutive updates"):
        trainer.fit()
    assert trainer.step == 0 and trainer.skipped_updates == 20


class NaNAt(Scalar):
    def __init__(self, bad_calls):
        super().__init__()
        self.calls = 0
        self.bad = set(bad_calls)

    def forward(self, inputs, labels):
        self.calls += 1
        loss = super().forward(inputs, labels)
        return loss * float("nan") if self.calls in self.bad else loss


def test_nonfinite_loss_stops_with_step_and_keeps_last_checkpoint(tmp_path):
    model = NaNAt({3})
    logger = quiet_logger()
    seen = events_of(logger)
    manager = CheckpointManager(tmp_path, every_steps=1, keep_last=None)
    trainer = sgd_trainer(
        model,
        scalar_batches(1.0),
        logger=logger,
        checkpoint_manager=manager,
        options=TrainerOptions(max_steps=5),
    )
    with pytest.raises(NonFiniteLossError, match="at step 3") as info:
        trainer.fit()
    assert info.value.step == 3
    assert (
        "nonfinite_loss",
        {"step": 3, "loss": seen[-1][1]["loss"], "elapsed_s": seen[-1][1]["elapsed_s"]},
    ) == seen[-1]
    assert [step for step, _ in manager.step_files()] == [1, 2]
    assert manager.load_latest()["step"] == 2


def test_nonfinite_loss_skips_when_configured():
    model = NaNAt({2})
    config = {"run": {"stop_on_nonfinite": False, "max_steps": 3}}
    trainer = sgd_trainer(model, scalar_batches(1.0), config=config)
    result = trainer.fit()
    assert result.steps == 3 and result.skipped_updates == 1
    assert torch.isfinite(model.p).all()


def test_grad_clip_limits_norm():
    model = Scalar()
    config = {"optimizer": {"grad_clip": 0.5}, "run": {"max_steps": 1}}
    trainer = sgd_trainer(model, scalar_batches(10.0), lr=1.0, config=config)
    result = trainer.fit()
    assert result.metrics[0]["grad_norm"] == pytest.approx(20.0)  # pre-clip norm is reported
    assert model.p.item() == pytest.approx(0.5)


def test_request_stop_from_a_thread_saves_final_checkpoint(tmp_path):
    model = TinyLM()
    logger = quiet_logger()
    seen = events_of(logger)
    manager = CheckpointManager(tmp_path, every_steps=1000)
    trainer = sgd_trainer(
        model,
        lm_batches(),
        logger=logger,
        checkpoint_manager=manager,
        options=TrainerOptions(max_steps=10_000),
    )

    def stopper(event, payload):
        if event == "train_step" and payload["step"] == 3:
            threading.Thread(target=trainer.request_stop, args=("test",)).start()

    logger.hooks.append(stopper)
    result = trainer.fit()
    assert result.stopped_reason == "test"
    assert 3 <= result.steps < 10
    assert manager.load_latest()["step"] == result.steps
    names = [e for e, _ in seen]
    assert names.index("train_stopped") < names.index("checkpoint_saved") < names.index("train_end")
    assert trainer.last_heartbeat > 0


class FakeCoordinator:
    """Records the trainer's calls; counts steps through the optimizer hook it attaches."""

    node_id = "fake"
    role = "worker"
    run_ended = None
    last_heartbeat = 0.0
    last_global_step = -1

    def __init__(self, trains=True):
        self.calls: list = []
        self.trains = trains
        self.steps = 0

    def is_ready(self):
        return True

    def wants_weights(self):
        return False

    def round_step(self, *, weights_current):
        return False

    def attach(self, optimizer, *, hook=True):  # idempotent, like the DiLoCo coordinator's
        self.calls.append("attach")
        if getattr(self, "optimizer", None) is not optimizer:
            self.optimizer = optimizer
            optimizer.register_step_post_hook(lambda *_: self._stepped())

    def _stepped(self):
        self.steps += 1
        self.calls.append(self.steps)

    def start(self, step=None):
        self.calls.append(("start", step))

    def finish(self):
        self.calls.append("finish")

    def interrupt(self):
        self.calls.append("interrupt")

    def stop(self):
        self.calls.append("stop")

    def state_dict(self):
        return {"outer_step": torch.tensor(3), "processed": ["a", "b"]}

    def load_state_dict(self, state):
        self.calls.append(("load", state))


def test_coordinator_hooks_the_optimizer_and_finishes_only_at_the_run_target():
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    coordinator = FakeCoordinator()
    trainer = Trainer(
        model,
        optimizer,
        lm_batches(),
        logger=quiet_logger(),
        coordinator=coordinator,
        options=TrainerOptions(max_steps=2),
    )
    trainer.fit(1)  # below the run target: no end-of-run
    trainer.fit(2)
    trainer.fit(2)  # at the target: the coordinator still runs its end of run (issue 20:
    # a master resumed at its last step serves the rounds still open)
    assert coordinator.calls == [
        "attach", ("start", 0), 1, "stop",
        "attach", ("start", 1), 2, "finish", "stop",
        "attach", ("start", 2), "finish", "stop",
    ]  # fmt: skip


def coordinated_trainer(coordinator: FakeCoordinator, max_steps: int) -> Trainer:
    """A `TinyLM` trained with AdamW (lr 0.01) on `lm_batches` under ``coordinator``."""
    model = TinyLM()
    return Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=0.01),
        lm_batches(),
        logger=quiet_logger(),
        coordinator=coordinator,
        options=TrainerOptions(max_steps=max_steps),
    )


def test_stop_request_interrupts_the_coordinator_and_skips_finish():
    coordinator = FakeCoordinator()
    trainer = coordinated_trainer(coordinator, max_steps=5)
    trainer.logger.hooks.append(
        lambda event, payload: trainer.request_stop("test") if event == "train_step" else None
    )
    result = trainer.fit()
    assert result.stopped_reason == "test" and result.steps == 1
    assert coordinator.calls == ["attach", ("start", 0), 1, "interrupt", "stop"]


def test_pure_aggregator_coordinator_runs_no_steps():
    coordinator = FakeCoordinator(trains=False)
    trainer = coordinated_trainer(coordinator, max_steps=5)
    result = trainer.fit()
    assert result.steps == 0
    assert coordinator.calls == ["attach", ("start", 0), "finish", "stop"]


def test_checkpoint_state_round_trips_and_coordinator_prepare(tmp_path):
    model = TinyLM()
    coordinator = FakeCoordinator()
    manager = CheckpointManager(tmp_path, every_steps=2)
    trainer = Trainer(
        model,
        torch.optim.AdamW(model.parameters()),
        lm_batches(),
        logger=quiet_logger(),
        checkpoint_manager=manager,
        coordinator=coordinator,
        options=TrainerOptions(max_steps=3),
    )
    trainer.fit()
    state = manager.load_latest()
    assert state["step"] == 3 and state["coordinator"]["processed"] == ["a", "b"]
    other = FakeCoordinator()
    fresh = Trainer(
        TinyLM(),
        torch.optim.AdamW(model.parameters()),
        lm_batches(),
        logger=quiet_logger(),
        coordinator=other,
        options=TrainerOptions(max_steps=3),
    )
    fresh.resume(state)
    assert other.calls == [("load", state["coordinator"])] and fresh.step == 3


def test_compile_runtime_failure_falls_back_to_eager(monkeypatch):
    class Exploding:
        def __init__(self, module):
            self.module = module

        def __call__(self, *args, **kwargs):
            raise RuntimeError("inductor unavailable")

    monkeypatch.setattr(torch, "compile", Exploding)
    logger = quiet_logger()
    seen = events_of(logger)
    model = TinyLM()
    config = {"compile": True, "run": {"max_steps": 2}}
    trainer = sgd_trainer(model, lm_batches(), config=config, logger=logger)
    result = trainer.fit()
    assert result.steps == 2
    compile_events = [p for e, p in seen if e == "compile"]
    assert compile_events[-1]["enabled"] is False
    assert "runtime failure; disabled: inductor unavailable" in compile_events[-1]["reason"]


def test_compile_construction_failure_falls_back(monkeypatch):
    def broken(module):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(torch, "compile", broken)
    logger = quiet_logger()
    seen = events_of(logger)
    model = TinyLM()
    config = {"compile": {"enabled": True}, "run": {"max_steps": 1}}
    Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        lm_batches(),
        config=config,
        logger=logger,
    ).fit()
    assert seen[0] == (
        "compile",
        {"enabled": False, "reason": "no compiler", "elapsed_s": seen[0][1]["elapsed_s"]},
    )


def test_gradient_checkpointing_hook_and_missing_hook_warning():
    stream = io.StringIO()
    model = TinyLM()
    calls = []
    model.set_gradient_checkpointing = calls.append
    config = {"gradient_checkpointing": True}
    Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        lm_batches(),
        config=config,
        logger=MetricLogger(stream=stream),
    )
    assert calls == [True]
    Trainer(
        TinyLM(),
        torch.optim.SGD(model.parameters(), lr=0.1),
        lm_batches(),
        config=config,
        logger=MetricLogger(stream=stream),
    )
    assert "no set_gradient_checkpointing hook" in stream.getvalue()


def test_ooo_backprop_on_cpu_is_disabled_and_training_works():
    logger = quiet_logger()
    seen = events_of(logger)
    model = TinyLM()
    config = {"ooo_backprop": True, "ooo_streams": 2, "run": {"max_steps": 2}}
    trainer = sgd_trainer(model, lm_batches(), config=config, logger=logger)
    assert trainer.fit().steps == 2
    ooo = [p for e, p in seen if e == "ooo_backprop"]
    assert ooo and ooo[0]["enabled"] is False and "cpu" in ooo[0]["reason"]


def test_list_loader_resume_fast_forwards_position():
    batches = lm_batches(5)
    model = TinyLM()
    first = sgd_trainer(model, batches, options=TrainerOptions(max_steps=7))
    first.fit(3)
    state = copy.deepcopy(first.state_dict())  # live tensors otherwise
    reference = first.fit(7).metrics
    torch.manual_seed(0)
    other = TinyLM()
    second = sgd_trainer(other, batches, options=TrainerOptions(max_steps=7))
    second.resume(state)
    assert [m["loss"] for m in second.fit().metrics] == [m["loss"] for m in reference]
