"""evaluate() against a hand computation, determinism, threads; the trainer's eval cadence."""

from __future__ import annotations

import copy
import io
import math
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from speedtronic.metrics.logger import MetricLogger
from speedtronic.train.evaluate import EvalResult, HeldOut, build_heldout, evaluate
from speedtronic.train.runtime import train_from_config
from speedtronic.train.trainer import Trainer, TrainerOptions


class TinyLM(nn.Module):
    """Logits from an embedding and a linear head (no loss: the trainer's CE is used)."""

    def __init__(self, vocab: int = 16, width: int = 8, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids, labels=None, attention_mask=None):
        return {"logits": self.head(self.drop(self.embed(input_ids)))}


def heldout_of(*batches) -> HeldOut:
    tokens = sum(int((labels != -100).sum()) for _, labels in batches)
    return HeldOut(tuple(batches), tokens, tokens, "test")


def random_batch(rows: int, length: int, vocab: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    window = torch.randint(vocab, (rows, length + 1), generator=g)
    return window[:, :-1], window[:, 1:]


def test_evaluate_matches_a_hand_computed_cross_entropy():
    torch.manual_seed(0)
    model = TinyLM()
    # Two batches of different sizes (and one ignored label): the mean is over target tokens,
    # not over batches.
    first = random_batch(3, 5, seed=1)
    inputs, labels = random_batch(1, 5, seed=2)
    labels = labels.clone()
    labels[0, 2] = -100
    result = evaluate(model, heldout_of(first, (inputs, labels)), device="cpu")
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in (first, (inputs, labels)):
            logp = F.log_softmax(model.head(model.embed(x)).double(), dim=-1)
            for row in range(x.shape[0]):
                for t in range(x.shape[1]):
                    if y[row, t] != -100:
                        total -= float(logp[row, t, y[row, t]])
                        count += 1
    assert count == 19 and result.tokens == 19
    assert result.loss == pytest.approx(total / count, rel=1e-6)
    assert result.perplexity == pytest.approx(math.exp(total / count), rel=1e-6)
    assert result.as_dict() == {"loss": result.loss, "perplexity": result.perplexity, "tokens": 19}


def test_evaluate_is_deterministic_restores_mode_and_ignores_dropout():
    torch.manual_seed(0)
    model = TinyLM(dropout=0.5)
    held = heldout_of(random_batch(4, 6), random_batch(4, 6, seed=3))
    model.train()
    first = evaluate(model, held, device="cpu")
    assert model.training  # restored
    model.eval()
    second = evaluate(model, held, device="cpu")
    assert not model.training
    assert first == second  # same weights -> the same number (dropout is off in eval)
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.head.bias.add_(1.0)
        other.head.weight.mul_(3.0)
    assert evaluate(other, held, device="cpu") != first


def test_evaluate_is_safe_next_to_training_in_another_thread():
    torch.manual_seed(0)
    model = TinyLM()
    held = heldout_of(*(random_batch(4, 8, seed=s) for s in range(6)))
    snapshot = copy.deepcopy(model)
    expected = evaluate(snapshot, held, device="cpu")
    results: list[EvalResult] = []

    def score() -> None:
        for _ in range(20):
            results.append(evaluate(snapshot, held, device="cpu"))

    thread = threading.Thread(target=score)
    thread.start()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(50):  # the live model trains meanwhile, with autograd on
        x, y = random_batch(4, 8, seed=100 + step)
        loss = F.cross_entropy(model(x)["logits"].reshape(-1, 16), y.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    thread.join()
    assert len(results) == 20 and all(r == expected for r in results)
    assert evaluate(model, held, device="cpu").loss != expected.loss


def test_evaluate_under_bf16_autocast_on_cpu():
    from speedtronic.train.precision import resolve_precision

    torch.manual_seed(0)
    model = TinyLM()
    held = heldout_of(random_batch(2, 4))
    plan = resolve_precision("bf16", torch.device("cpu"))
    assert plan.autocast_enabled
    exact = evaluate(model, held, device="cpu")
    mixed = evaluate(model, held, device="cpu", precision=plan)
    assert mixed.loss == pytest.approx(exact.loss, rel=0.05) and mixed.tokens == exact.tokens


# --------------------------------------------------------------------------- trainer cadence
class StopsLast:
    """A coordinator whose stop() replaces the weights (as a final global install does)."""

    node_id = "n"

    def __init__(self, model: nn.Module, log: list) -> None:
        self.model, self.log = model, log

    def start(self) -> None:
        self.log.append(("coordinator_start", {}))

    def after_optimizer_step(self, model, step) -> bool:
        return False

    def stop(self) -> None:
        with torch.no_grad():
            for parameter in self.model.parameters():
                parameter.zero_()  # uniform logits: loss ln(16)
        self.log.append(("coordinator_stop", {}))

    def state_dict(self) -> dict:
        return {}


class Manager:
    """A checkpoint manager stand-in that records saves."""

    enabled = True
    save_final = True

    def __init__(self, log: list) -> None:
        self.log = log

    def start(self) -> None:  # CheckpointManager.start: the run's training begins
        self.log.append(("start", {}))

    def should_save(self, step: int) -> bool:
        return False

    def save(self, step: int, state: dict) -> str:
        self.log.append(("saved", {"step": step}))
        return f"step_{step}.pt"


def lm_batches(n: int = 100):
    return [random_batch(2, 6, seed=s) for s in range(n)]


def test_trainer_emits_eval_at_the_cadence_and_at_the_end_after_the_coordinator_stops():
    torch.manual_seed(0)
    model = TinyLM()
    log: list = []
    logger = MetricLogger(stream=io.StringIO())
    logger.hooks.append(lambda event, payload: log.append((event, dict(payload))))
    held = heldout_of(random_batch(4, 6, seed=99))
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        lm_batches(),
        config={"eval": {"every_steps": 3}},
        logger=logger,
        coordinator=StopsLast(model, log),
        checkpoint_manager=Manager(log),
        options=TrainerOptions(max_steps=7, heldout=held),
    )
    trainer.fit()
    evals = [payload for event, payload in log if event == "eval"]
    assert [e["step"] for e in evals] == [0, 3, 6, 7]
    assert all(e["scope"] == "local" and e["tokens"] == held.tokens for e in evals)
    assert evals[-1]["perplexity"] == pytest.approx(math.exp(evals[-1]["loss"]))
    order = [event for event, _ in log if event in {"coordinator_stop", "eval", "saved"}]
    assert order[-3:] == ["coordinator_stop", "eval", "saved"]  # final eval between them
    assert evals[-1]["loss"] == pytest.approx(math.log(16))  # it saw the installed weights


def test_trainer_eval_every_zero_means_only_at_the_end_and_no_heldout_means_none():
    torch.manual_seed(0)
    model = TinyLM()
    logger = MetricLogger(stream=io.StringIO())
    seen: list = []
    logger.hooks.append(lambda event, payload: seen.append((event, payload.get("step"))))
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        lm_batches(),
        config={"eval": {"every_steps": 0}},
        logger=logger,
        options=TrainerOptions(max_steps=4, heldout=heldout_of(random_batch(2, 6))),
    )
    trainer.fit()
    assert [step for event, step in seen if event == "eval"] == [4]
    seen.clear()
    plain = Trainer(
        TinyLM(), torch.optim.SGD(model.parameters(), lr=0.1), lm_batches(), logger=logger
    )
    plain.fit(2)
    assert not any(event == "eval" for event, _ in seen)


def test_a_smoke_sized_run_learns_the_markov_chain(tmp_path):
    """The shipped smoke shape on held-out Markov data: eval loss falls well below ln(V)."""
    values = {
        "run": {"device": "cpu", "max_steps": 120, "output_dir": str(tmp_path)},
        "model": {"vocab_size": 64, "max_seq_len": 16, "n_layer": 1, "n_head": 2, "d_model": 32},
        "data": {"num_tokens": 1024, "micro_batch_size": 4, "target_batch_size": 4},
        "optimizer": {"lr": 1e-2, "weight_decay": 0.0},
        "scheduler": {"warmup_steps": 5},
        "precision": "fp32",
        "checkpoint": {"enabled": False},
        "logging": {"level": "WARNING", "json_file": str(tmp_path / "e.jsonl")},
        "eval": {"holdout": 0.1, "every_steps": 40, "tokens": 1024, "batch_size": 16},
    }
    train_from_config(values)
    import json

    records = [json.loads(line) for line in (tmp_path / "e.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["event"] == "eval"]
    assert [e["step"] for e in evals] == [0, 40, 80, 120]
    floor = build_heldout(_config(values)).floor
    start, end = evals[0]["loss"], evals[-1]["loss"]
    assert start == pytest.approx(math.log(64), abs=0.3)
    assert end < math.log(64) - 2.0  # clearly learnt
    assert end - floor < 0.5 * (start - floor)  # more than half way to the floor
    assert end > floor - 0.05  # and never below it: the floor is a real bound


def _config(values: dict):
    from speedtronic.config import SpeedtronicConfig

    return SpeedtronicConfig.from_dict(values)
