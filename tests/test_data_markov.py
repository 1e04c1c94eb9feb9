"""The learnable synthetic default: the Markov chain, its floor, data.synthetic choices, cost."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch

from speedtronic.config import ConfigError, DataConfig, SpeedtronicConfig, resolve_config
from speedtronic.data import (
    MarkovChain,
    MarkovTokenDataset,
    SyntheticTokenDataset,
    build_dataloader,
    infinite_batches,
)
from speedtronic.data.markov import HELDOUT_DOMAIN, RESOLUTION, SUCCESSORS


def test_chain_is_a_function_of_vocab_and_seed_only():
    a, b, c = MarkovChain(64, 7), MarkovChain(64, 7), MarkovChain(64, 8)
    assert np.array_equal(a.successors, b.successors) and np.array_equal(a.probs, b.probs)
    assert a.floor == b.floor
    assert not np.array_equal(a.successors, c.successors)
    # The sample seed never changes the chain (every DiLoCo node shares it).
    one = MarkovTokenDataset(4, 8, 64, 7, sample_seed=1)
    two = MarkovTokenDataset(4, 8, 64, 7, sample_seed=2)
    assert np.array_equal(one.chain.successors, two.chain.successors)
    assert not torch.equal(one[0]["input_ids"], two[0]["input_ids"])


def test_chain_structure_and_floor_formula():
    chain = MarkovChain(100, 3)
    assert chain.successors.shape == (100, SUCCESSORS)
    assert all(len(set(row)) == SUCCESSORS for row in chain.successors.tolist())
    assert np.allclose(chain.probs.sum(axis=1), 1.0)
    assert np.all(chain.probs * RESOLUTION == np.round(chain.probs * RESOLUTION))  # quantised
    assert chain.probs.max(axis=1).mean() > 1.5 / SUCCESSORS  # skewed, not uniform
    # pi is stationary: pi P == pi.
    moved = np.zeros(100)
    np.add.at(moved, chain.successors.ravel(), (chain.stationary[:, None] * chain.probs).ravel())
    assert np.allclose(moved, chain.stationary, atol=1e-9)
    assert chain.stationary.min() > 0  # irreducible: every token is reachable
    rows = -(chain.probs * np.log(chain.probs)).sum(axis=1)
    assert chain.floor == pytest.approx(float(chain.stationary @ rows))
    assert 0.3 < chain.floor < math.log(SUCCESSORS) < chain.uniform_loss == math.log(100)


def test_floor_is_the_cross_entropy_of_the_true_transitions_on_samples():
    """The Bayes-optimal predictor scores the floor on generated data (the floor is honest)."""
    dataset = MarkovTokenDataset(1500, 32, 128, 1234)
    chain = dataset.chain
    lookup = {
        (s, int(t)): float(p)
        for s in range(128)
        for t, p in zip(chain.successors[s], chain.probs[s], strict=True)
    }
    total, count = 0.0, 0
    for index in range(len(dataset)):
        record = dataset[index]
        for x, y in zip(record["input_ids"].tolist(), record["labels"].tolist(), strict=True):
            total -= math.log(lookup[(x, y)])  # KeyError if a transition is not in the chain
            count += 1
    assert total / count == pytest.approx(chain.floor, abs=0.03)


def test_samples_are_deterministic_indexed_and_shifted():
    ds = MarkovTokenDataset(10, 16, 50, 5)
    again = MarkovTokenDataset(10, 16, 50, 5)
    for i in (9, 0, 3):
        assert torch.equal(ds[i]["input_ids"], again[i]["input_ids"])
        assert torch.equal(ds[i]["input_ids"][1:], ds[i]["labels"][:-1])
        assert ds[i]["input_ids"].dtype == torch.int64 and ds[i]["input_ids"].shape == (16,)
    assert torch.equal(ds[-1]["labels"], ds[9]["labels"])
    assert not torch.equal(ds[0]["input_ids"], ds[1]["input_ids"])
    with pytest.raises(IndexError):
        ds[10]
    held = MarkovTokenDataset(10, 16, 50, 5, domain=HELDOUT_DOMAIN)
    assert not any(torch.equal(held[i]["input_ids"], ds[i]["input_ids"]) for i in range(10))


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        (True, "markov"),
        (False, "none"),
        ("true", "markov"),
        ("off", "none"),
        ("uniform", "uniform"),
        ("Markov", "markov"),
        ("none", "none"),
        (1, "markov"),
    ],
)
def test_data_synthetic_values(value, kind):
    assert DataConfig(synthetic=value).synthetic == kind
    assert SpeedtronicConfig.from_dict({"data": {"synthetic": value}}).data.synthetic == kind


@pytest.mark.parametrize("bad", ["bogus", 2, None, [1]])
def test_data_synthetic_rejects_other_values(bad):
    with pytest.raises(ConfigError, match=r"data\.synthetic must be 'markov', 'uniform' or 'none'"):
        DataConfig(synthetic=bad)


def test_data_synthetic_from_yaml_and_environment(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  synthetic: true\n")
    assert SpeedtronicConfig.from_yaml(path).data.synthetic == "markov"
    env = {"SPEEDTRONIC_DATA__SYNTHETIC": "uniform"}
    resolved = resolve_config(str(path), environ=env, secrets_dir=str(tmp_path / "none"))
    assert resolved.config.data.synthetic == "uniform"
    env = {"SPEEDTRONIC_DATA__SYNTHETIC": "false"}
    resolved = resolve_config(str(path), environ=env, secrets_dir=str(tmp_path / "none"))
    assert resolved.config.data.synthetic == "none"
    assert SpeedtronicConfig().data.synthetic == "markov"  # the default


def test_loader_picks_the_synthetic_kind_and_uniform_is_unchanged():
    def config(kind: str) -> DataConfig:
        return DataConfig(
            synthetic=kind, num_tokens=8, block_size=8, micro_batch_size=2, target_batch_size=2
        )

    markov = build_dataloader(config("markov"), vocab_size=32)
    assert isinstance(markov.dataset, MarkovTokenDataset) and markov.dataset.floor > 0
    uniform = build_dataloader(config("uniform"), vocab_size=32)
    assert type(uniform.dataset) is SyntheticTokenDataset
    reference = SyntheticTokenDataset(num_samples=8, block_size=8, vocab_size=32, seed=0)
    inputs, _ = next(iter(uniform))
    assert torch.equal(inputs[0], reference[0]["input_ids"])  # 2.0.0's samples, exactly
    with pytest.raises(ConfigError, match=r"data\.synthetic: false but no data source"):
        build_dataloader(config("none"))


def test_markov_loader_with_workers_matches_the_single_process_stream():
    cfg = DataConfig(
        num_tokens=12, block_size=8, micro_batch_size=2, target_batch_size=2, shuffle=True
    )
    single = infinite_batches(build_dataloader(cfg, vocab_size=64))
    workers = DataConfig(**{**cfg.__dict__, "num_workers": 2})
    parallel = infinite_batches(build_dataloader(workers, vocab_size=64))
    for _ in range(8):
        assert torch.equal(next(single)[0], next(parallel)[0])


def test_sample_generation_does_not_dominate_a_smoke_step():
    """A smoke step draws target_batch_size=2 windows of 33 tokens; measured against the step."""
    from speedtronic.model import build_model

    config = SpeedtronicConfig.from_yaml("configs/smoke.yaml")
    model = build_model(config.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dataset = MarkovTokenDataset(1000, 32, config.model.vocab_size, 1234)
    batch = torch.stack([dataset[i]["input_ids"] for i in range(2)])

    def generate() -> None:
        for i in range(2):
            dataset[i]

    def step() -> None:
        out = model(batch[:1], batch[:1])
        out["loss"].backward()
        out = model(batch[1:], batch[1:])
        out["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()

    def best(fn, repeats: int = 30) -> float:
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
        return min(times)

    step()  # warm up
    assert best(generate) < 0.25 * best(step)
