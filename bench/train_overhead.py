"""Trainer overhead: ``train_from_config`` vs a minimal hand-written PyTorch loop.

Both arms train the same reference model (same config, seed, data, AdamW and LR schedule) for
N optimizer steps, interleaved in one process (alternating order, several repeats); the figure
per arm is the median tokens/s over repeats of the timed training loop: ``trainer.fit()`` after
``build_runtime`` (exactly what ``train_from_config`` runs) vs the hand loop; model/optimizer
construction is excluded in both arms. Wall-clock tokens/s give the headline ratio; CPU-time
tokens/s (``time.process_time``, single-threaded torch) are reported too because they are robust
against other processes competing for the cores. Checkpoints and per-step text lines are off so the
comparison measures the loop itself: forward/backward with accumulation, loss bookkeeping,
gradient norm, scheduler, metric dicts and the JSONL-free logger.

    python bench/train_overhead.py                    # smoke + ~10M models, prints a table
    python bench/train_overhead.py --steps 20 --repeats 5 --out bench/results/x.json

The losses of the two arms are compared too (same seed: equal up to float32 summation order).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from speedtronic.config import SpeedtronicConfig  # noqa: E402
from speedtronic.data import build_dataloader  # noqa: E402
from speedtronic.model import build_model  # noqa: E402
from speedtronic.optim import build_optimizer, build_scheduler  # noqa: E402
from speedtronic.train.runtime import build_runtime, seed_everything  # noqa: E402

MODELS: dict[str, dict[str, Any]] = {
    "smoke": {
        "model": {
            "vocab_size": 128,
            "max_seq_len": 32,
            "n_layer": 2,
            "n_head": 4,
            "n_kv_head": 2,
            "d_model": 64,
            "d_ff": 128,
        },
        "data": {"micro_batch_size": 4, "target_batch_size": 8},
    },
    "10m": {
        "model": {
            "vocab_size": 8192,
            "max_seq_len": 64,
            "n_layer": 4,
            "n_head": 6,
            "d_model": 384,
        },
        "data": {"micro_batch_size": 2, "target_batch_size": 4},
    },
}


def make_config(name: str, steps: int, output_dir: str) -> SpeedtronicConfig:
    """The benchmark config for model ``name``: CPU fp32, uniform synthetic data (the cheapest
    source, as before 2.1's Markov default), no checkpoints."""
    spec = MODELS[name]
    return SpeedtronicConfig.from_dict(
        {
            "run": {"seed": 1234, "device": "cpu", "max_steps": steps, "output_dir": output_dir},
            "model": {**spec["model"], "dropout": 0.0},
            "data": {"synthetic": "uniform", "num_tokens": 4096, **spec["data"]},
            "optimizer": {"name": "adamw", "lr": 3e-4, "weight_decay": 0.01},
            "scheduler": {"name": "cosine", "warmup_steps": 2},
            "precision": "fp32",
            "checkpoint": {"enabled": False},
            "logging": {"level": "WARNING"},
        }
    )


def run_trainer(config: SpeedtronicConfig) -> tuple[float, float, list[float]]:
    """Wall and CPU tokens/s and per-step losses of ``train_from_config``'s two stages.

    ``train_from_config`` is ``build_runtime`` + ``trainer.fit()`` + ``logger.close()``; only
    ``fit()`` is timed, like only the loop is timed in the hand-written arm.
    """
    trainer, _ = build_runtime(config)
    wall, cpu = time.perf_counter(), time.process_time()
    result = trainer.fit()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    trainer.logger.close()
    return result.tokens / wall, result.tokens / cpu, [m["loss"] for m in result.metrics]


def run_hand_loop(config: SpeedtronicConfig) -> tuple[float, float, list[float]]:
    """tokens/s and per-step losses of a minimal PyTorch loop on the same model/data/seed."""
    seed_everything(config.run.seed)
    model = build_model(config.model)
    loader = build_dataloader(config.data, vocab_size=config.model.vocab_size)
    optimizer = build_optimizer(model, config, "cpu")
    scheduler = build_scheduler(optimizer, config)
    accumulation = config.data.accumulation_steps
    losses, tokens = [], 0
    wall, cpu = time.perf_counter(), time.process_time()
    model.train()
    batches = iter(loader)
    for _ in range(config.run.max_steps):
        total = 0.0
        for _ in range(accumulation):
            inputs, labels = next(batches)
            loss = model(inputs, labels)["loss"]
            (loss / accumulation).backward()
            total += loss.item()
            tokens += inputs.numel()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total / accumulation)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return tokens / wall, tokens / cpu, losses


def bench_model(name: str, steps: int, repeats: int) -> dict[str, Any]:
    """Interleave both arms ``repeats`` times; medians, ratio and a loss comparison."""
    rates: dict[str, list[float]] = {"trainer": [], "hand": []}
    cpu_rates: dict[str, list[float]] = {"trainer": [], "hand": []}
    max_loss_diff = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        config = make_config(name, steps, tmp)
        params = sum(p.numel() for p in build_model(config.model).parameters())
        run_hand_loop(make_config(name, 1, tmp))  # warm-up (first optimizer import, allocator)
        for repeat in range(repeats):
            arms = [("trainer", run_trainer), ("hand", run_hand_loop)]
            if repeat % 2:
                arms.reverse()
            losses: dict[str, list[float]] = {}
            for arm, fn in arms:
                rate, cpu_rate, losses[arm] = fn(make_config(name, steps, f"{tmp}/{arm}{repeat}"))
                rates[arm].append(rate)
                cpu_rates[arm].append(cpu_rate)
            pairs = zip(losses["trainer"], losses["hand"], strict=True)
            max_loss_diff = max(max_loss_diff, *(abs(a - b) for a, b in pairs))
    trainer = statistics.median(rates["trainer"])
    hand = statistics.median(rates["hand"])
    cpu_ratio = statistics.median(cpu_rates["trainer"]) / statistics.median(cpu_rates["hand"])
    return {
        "model": name,
        "parameters": params,
        "steps": steps,
        "repeats": repeats,
        "trainer_tokens_per_sec": trainer,
        "hand_loop_tokens_per_sec": hand,
        "ratio": trainer / hand,
        "cpu_time_ratio": cpu_ratio,
        "trainer_runs": rates["trainer"],
        "hand_loop_runs": rates["hand"],
        "trainer_cpu_runs": cpu_rates["trainer"],
        "hand_loop_cpu_runs": cpu_rates["hand"],
        "max_loss_difference": max_loss_diff,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--steps", type=int, default=None, help="steps per run (per model default)")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "train_overhead.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    default_steps = {"smoke": 60, "10m": 8}
    results = []
    for name in args.models:
        row = bench_model(name, args.steps or default_steps[name], args.repeats)
        results.append(row)
        print(
            f"{name:>6} ({row['parameters'] / 1e6:.2f}M params, {row['steps']} steps x "
            f"{row['repeats']}): trainer {row['trainer_tokens_per_sec']:.0f} tok/s, "
            f"hand loop {row['hand_loop_tokens_per_sec']:.0f} tok/s, "
            f"ratio {row['ratio']:.3f} (CPU-time ratio {row['cpu_time_ratio']:.3f}), "
            f"max loss difference {row['max_loss_difference']:.2g}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": "train_overhead",
                "torch": str(torch.__version__),
                "python": platform.python_version(),
                "machine": platform.machine(),
                "threads": args.threads,
                "results": results,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
