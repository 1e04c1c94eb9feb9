"""GPU throughput: the Speedtronic trainer vs a minimal hand-written loop, GPT-2 small on CUDA.

The CUDA sibling of ``bench/train_overhead.py`` (same two arms, same fairness rules: same config,
seed, model, data stream, optimizer and LR schedule; construction and warm-up excluded; losses
compared). Here both arms train the GPT-2-small-sized reference model (12 layers, d_model 768,
12 heads, vocab 50304, tied embeddings, ~124M parameters, sequence 1024) with bf16 autocast over
fp32 master weights, ``torch.compile`` and fused AdamW (``--optimizer muon``: the hybrid
Muon/AdamW, Newton–Schulz in bf16 by ``optimizer.muon_ns_dtype: auto``), with gradient clipping at
1.0 and a cosine schedule:

* ``trainer``: ``build_runtime(config)`` then ``trainer.fit()`` — the code ``speedtronic train``
  runs (one host sync per update for the loss and grad norm, step metrics, memory readings).
* ``hand``: nanoGPT-style loop on the same objects' builders: ``torch.compile(model)``,
  ``torch.autocast(bfloat16)``, ``backward`` per micro-batch, ``clip_grad_norm_``,
  ``optimizer.step()``, ``scheduler.step()``, ``zero_grad(set_to_none=True)``; losses stay on the
  device until the end (no per-step host sync).

Both arms are built and warmed up (compile included) first, then timed in ``--repeats`` segments
of ``--steps`` updates, interleaved ABBA, with ``torch.cuda.synchronize`` around each segment.
Reported per arm: median tokens/s, MFU = 6·N·tokens/s / ``--peak-flops`` (N = unique trainable
parameters; attention FLOPs not counted, as in the issue's definition; the PaLM-style figure with
12·L·d·T per token is reported beside it) and the peak CUDA memory allocated above what was
allocated before the arm was built; then the ratio trainer / hand (target >= 0.97) and whether the
trainer's MFU reaches 45%.

    python bench/gpu_throughput.py                              # H100/H200: < 5 minutes
    python bench/gpu_throughput.py --optimizer muon --peak-flops 312e12   # A100 peak
    python bench/gpu_throughput.py --device cpu --tiny          # smoke run of the code path

Without CUDA (or ``--device cpu`` without ``--tiny``) it prints one line on stderr and exits 2.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
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

H100_PEAK_BF16_FLOPS = 989e12
"""Dense bf16 tensor-core peak of an H100/H200 SXM (FLOP/s, no sparsity)."""
EXIT_NO_DEVICE = 2

SHAPES: dict[str, dict[str, Any]] = {
    "gpt2-124m": {
        "model": {
            "vocab_size": 50304,
            "max_seq_len": 1024,
            "n_layer": 12,
            "n_head": 12,
            "d_model": 768,
            "d_ff": 3072,
            "tie_weights": True,
        },
        "micro_batch_size": 16,
        "accumulation": 4,
    },
    "tiny": {  # the --tiny smoke shape: seconds on one CPU core
        "model": {
            "vocab_size": 256,
            "max_seq_len": 32,
            "n_layer": 2,
            "n_head": 4,
            "n_kv_head": 2,
            "d_model": 64,
            "d_ff": 128,
        },
        "micro_batch_size": 2,
        "accumulation": 2,
    },
}


class DeviceUnavailable(Exception):
    """The requested device cannot run this benchmark (exit code 2)."""


def check_device(device: str, tiny: bool) -> torch.device:
    """The device to run on; raises :class:`DeviceUnavailable` with a one-line reason."""
    resolved = torch.device(device)
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailable(
                "bench/gpu_throughput.py needs a CUDA GPU and torch.cuda.is_available() is False "
                f"(torch {torch.__version__}); run it on a GPU machine, or use "
                "--device cpu --tiny for a smoke run of the code path"
            )
        return resolved
    if not tiny:
        raise DeviceUnavailable(
            f"bench/gpu_throughput.py measures GPU throughput; --device {device} is only "
            "supported with --tiny (a smoke run whose figures mean nothing)"
        )
    return resolved


def make_config(args: argparse.Namespace, device: torch.device, output_dir: str) -> Any:
    """The benchmark config: shape, bf16 (CUDA) or fp32 (CPU), compile, no checkpoints/eval."""
    shape = SHAPES["tiny" if args.tiny else "gpt2-124m"]
    micro = args.micro_batch_size or shape["micro_batch_size"]
    accumulation = args.accumulation or shape["accumulation"]
    block = shape["model"]["max_seq_len"]
    total_steps = args.warmup + args.repeats * args.steps
    return SpeedtronicConfig.from_dict(
        {
            "run": {
                "seed": 1234,
                "device": str(device),
                "max_steps": total_steps,
                "output_dir": output_dir,
            },
            "model": {**shape["model"], "dropout": 0.0},
            "data": {
                "synthetic": "uniform",
                "num_tokens": max(4096, 2 * total_steps * micro * accumulation),
                "block_size": block,
                "micro_batch_size": micro,
                "target_batch_size": micro * accumulation,
            },
            "optimizer": {
                "name": args.optimizer,
                "lr": 6e-4,
                "weight_decay": 0.1,
                "grad_clip": 1.0,
            },
            "scheduler": {"name": "cosine", "warmup_steps": max(1, args.warmup)},
            "precision": "bf16" if device.type == "cuda" else "fp32",
            "compile": args.compile,
            "checkpoint": {"enabled": False},
            "logging": {"level": "WARNING"},
        }
    )


def sync(device: torch.device) -> None:
    """Wait for queued kernels (CUDA), so wall time covers the work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def allocated(device: torch.device) -> int:
    """Bytes currently allocated by tensors on ``device`` (0 on CPU)."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def reset_peak(device: torch.device) -> None:
    """Start a fresh peak-memory window (CUDA)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak(device: torch.device) -> int | None:
    """Peak allocated bytes since :func:`reset_peak` (``None`` on CPU)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


class TrainerArm:
    """The framework: ``build_runtime`` + ``Trainer.fit`` to an advancing step target."""

    name = "trainer"

    def __init__(self, config: Any) -> None:
        self.trainer, _ = build_runtime(config)
        self.model = self.trainer.model

    def run(self, steps: int) -> tuple[int, list[float]]:
        """``steps`` more updates; returns (tokens trained, per-update losses)."""
        tokens = self.trainer.tokens
        result = self.trainer.fit(self.trainer.step + steps)
        return self.trainer.tokens - tokens, [float(m["loss"]) for m in result.metrics]

    def close(self) -> None:
        """Close the trainer's log files."""
        self.trainer.logger.close()


class HandArm:
    """A minimal PyTorch loop on the same model, data stream, optimizer and schedule."""

    name = "hand"

    def __init__(self, config: Any) -> None:
        seed_everything(config.run.seed)  # same initial weights as the trainer arm
        self.device = torch.device(config.run.device)
        self.model = build_model(config.model).to(self.device)
        self.optimizer = build_optimizer(self.model, config, self.device)
        self.scheduler = build_scheduler(self.optimizer, config)
        self.forward = torch.compile(self.model) if config.compile else self.model
        pinned = self.device.type == "cuda"
        loader = build_dataloader(
            config.data, vocab_size=config.model.vocab_size, pin_memory_device=pinned
        )
        self.batches = iter(loader)
        self.accumulation = config.data.accumulation_steps
        self.clip = float(config.optimizer.grad_clip)
        self.autocast_dtype = torch.bfloat16 if config.precision.mode == "bf16" else None
        self.params = [p for p in self.model.parameters() if p.requires_grad]

    def run(self, steps: int) -> tuple[int, list[float]]:
        """``steps`` more updates; returns (tokens trained, per-update losses)."""
        self.model.train()
        tokens, losses = 0, []
        for _ in range(steps):
            total = torch.zeros((), device=self.device)
            for _ in range(self.accumulation):
                inputs, labels = next(self.batches)
                inputs = inputs.to(self.device, non_blocking=True)
                labels = labels.to(self.device, non_blocking=True)
                with self.autocast():
                    loss = self.forward(inputs, labels)["loss"]
                (loss / self.accumulation).backward()
                total += loss.detach()
                tokens += inputs.numel()
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            losses.append(total / self.accumulation)
        return tokens, torch.stack(losses).tolist() if losses else []

    def autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast (CUDA runs), or nothing (fp32 smoke runs)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def close(self) -> None:
        """Nothing to close."""


def build_and_warm(
    make: Callable[[Any], Any], config: Any, device: torch.device, warmup: int
) -> tuple[Any, int | None, list[float]]:
    """Build an arm, run ``warmup`` untimed updates (compile happens here); its memory peak."""
    sync(device)
    base = allocated(device)
    reset_peak(device)
    arm = make(config)
    _, losses = arm.run(warmup) if warmup else (0, [])
    sync(device)
    top = peak(device)
    return arm, (top - base if top is not None else None), losses


def run_bench(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Build and warm both arms, time interleaved segments, return the figures."""
    with tempfile.TemporaryDirectory() as tmp:
        config = make_config(args, device, tmp)
        tokens_per_step = config.data.target_batch_size * config.data.block_size
        arms: dict[str, Any] = {}
        memory: dict[str, int | None] = {}
        losses: dict[str, list[float]] = {}
        for make in (HandArm, TrainerArm):
            arm, memory[make.name], losses[make.name] = build_and_warm(
                make, config, device, args.warmup
            )
            arms[arm.name] = arm
        params = sum(p.numel() for p in arms["hand"].model.parameters() if p.requires_grad)
        rates: dict[str, list[float]] = {name: [] for name in arms}
        for repeat in range(args.repeats):
            order = ["trainer", "hand"] if repeat % 2 == 0 else ["hand", "trainer"]
            for name in order:
                sync(device)
                start = time.perf_counter()
                tokens, segment = arms[name].run(args.steps)
                sync(device)
                rates[name].append(tokens / (time.perf_counter() - start))
                losses[name].extend(segment)
        for arm in arms.values():
            arm.close()
        del arms
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    model = config.model
    attention_per_token = 12 * model.n_layer * model.d_model * config.data.block_size
    result: dict[str, Any] = {
        "parameters": params,
        "tokens_per_step": tokens_per_step,
        "peak_flops": args.peak_flops,
        "arms": {},
    }
    for name in ("trainer", "hand"):
        rate = statistics.median(rates[name])
        result["arms"][name] = {
            "tokens_per_sec": rate,
            "tokens_per_sec_runs": rates[name],
            "mfu": 6 * params * rate / args.peak_flops,
            "mfu_with_attention": (6 * params + attention_per_token) * rate / args.peak_flops,
            "peak_memory_bytes": memory[name],
        }
    result["ratio"] = (
        result["arms"]["trainer"]["tokens_per_sec"] / (result["arms"]["hand"]["tokens_per_sec"])
    )
    pairs = zip(losses["trainer"], losses["hand"], strict=True)
    result["max_loss_difference"] = max(abs(a - b) for a, b in pairs)
    result["final_loss"] = {name: values[-1] for name, values in losses.items()}
    return result


def describe_device(device: torch.device) -> str:
    """A human-readable device name."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} (CPU)"


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    """Print one line per arm, the ratio and the target checks."""
    for name in ("trainer", "hand"):
        arm = result["arms"][name]
        memory = arm["peak_memory_bytes"]
        memory_text = "n/a" if memory is None else f"{memory / 2**30:.2f} GiB"
        print(
            f"{name:>8}: {arm['tokens_per_sec']:12.0f} tok/s  MFU {100 * arm['mfu']:5.1f}% "
            f"(with attention {100 * arm['mfu_with_attention']:5.1f}%)  peak memory {memory_text}"
        )
    ratio, mfu = result["ratio"], result["arms"]["trainer"]["mfu"]
    print(
        f"   ratio: trainer / hand loop = {ratio:.3f} (target >= 0.97: "
        f"{'met' if ratio >= 0.97 else 'MISSED'}); trainer MFU {100 * mfu:.1f}% of "
        f"{args.peak_flops:.3g} FLOP/s (target >= 45% on H100/H200: "
        f"{'met' if mfu >= 0.45 else 'MISSED'}); max loss difference "
        f"{result['max_loss_difference']:.3g}"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny model: smoke run (any device)")
    parser.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw")
    parser.add_argument("--steps", type=int, default=20, help="timed updates per segment")
    parser.add_argument("--repeats", type=int, default=4, help="timed segments per arm")
    parser.add_argument("--warmup", type=int, default=5, help="untimed updates (compile)")
    parser.add_argument("--micro-batch-size", type=int, default=None)
    parser.add_argument("--accumulation", type=int, default=None, help="micro-batches/update")
    parser.add_argument(
        "--peak-flops",
        type=float,
        default=H100_PEAK_BF16_FLOPS,
        help="the device's peak dense bf16 FLOP/s (default: H100/H200 SXM, 989e12)",
    )
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile both arms (default: on for CUDA, off on CPU)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "gpu_throughput.json"))
    args = parser.parse_args(argv)
    if min(args.steps, args.repeats) < 1 or args.warmup < 0:
        parser.error("--steps and --repeats must be >= 1 and --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 on success, 2 when no usable device (one line on stderr)."""
    args = parse_args(argv)
    try:
        device = check_device(args.device, args.tiny)
    except DeviceUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_NO_DEVICE
    if args.compile is None:
        args.compile = device.type == "cuda"
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    result = run_bench(args, device)
    result.update(
        benchmark="gpu_throughput",
        device=describe_device(device),
        torch=str(torch.__version__),
        optimizer=args.optimizer,
        compile=args.compile,
        shape="tiny" if args.tiny else "gpt2-124m",
        steps=args.steps,
        repeats=args.repeats,
        warmup=args.warmup,
        wall_s=time.perf_counter() - started,
    )
    print(
        f"{result['device']}, torch {result['torch']}, {result['shape']} "
        f"({result['parameters'] / 1e6:.1f}M params, {result['tokens_per_step']} tokens/update), "
        f"{args.optimizer}, compile {args.compile}, {args.repeats}x{args.steps} timed updates "
        f"per arm, {result['wall_s']:.0f} s in all"
    )
    report(result, args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
