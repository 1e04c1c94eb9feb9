"""Optimizer benchmarks: step time/memory, our Muon vs torch.optim.Muon, short convergence runs.

Three parts, all in one process on the same CPU (or ``--device cuda``):

1. ``step``: optimizer step time and state memory of AdamW, cautious AdamW, Muon (hybrid),
   Muon+ and Muon+cautious on the parameters of a reference-transformer shape (fixed random
   gradients, so only ``optimizer.step()`` is timed).
2. ``muon_vs_torch``: our :class:`speedtronic.optim.Muon` vs ``torch.optim.Muon`` on the same
   Muon-routed matrices, same hyper-parameters (lr 0.02, wd 0.1, momentum 0.95, Nesterov, 5 NS
   steps), interleaved step by step; the ratio is ours / torch (lower is faster). ``torch.optim
   .Muon`` always runs Newton–Schulz in bfloat16; ours uses ``muon_ns_dtype: auto`` (bf16 on
   CUDA and on CPUs with native bf16 matmul, fp32 otherwise; the resolved dtype and the CPU
   detection are printed), so a peer with torch's iteration patched to float32 is reported too.
3. ``convergence``: AdamW vs cautious AdamW vs Muon (config path: one lr for both branches) vs
   Muon+ on a tiny reference transformer learning a fixed random Markov chain; same seed, data
   and steps; a small lr sweep per optimizer; plot of the best run of each to PNG. Muon is also
   run with Newton–Schulz forced to bf16 and to fp32 (``muon_ns_bf16`` / ``muon_ns_fp32``) so the
   held-out losses show whether the working precision changes convergence.

    python bench/optimizers.py                     # ~1-2 minutes of CPU
    python bench/optimizers.py --quick             # smoke: seconds
    python bench/optimizers.py --out bench/results/optimizers.json --plot docs/img/x.png
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from speedtronic.config import OptimizerConfig
from speedtronic.model import ReferenceTransformer
from speedtronic.optim import (
    Muon,
    build_optimizer,
    cpu_has_native_bf16,
    resolve_ns_dtype,
    route_parameters,
)

ROOT = Path(__file__).resolve().parents[1]


def optimizer_config(name: str, lr: float, **flags) -> OptimizerConfig:
    """An ``optimizer`` section with the config defaults (weight decay 0.1) and ``flags``."""
    return OptimizerConfig(name=name, lr=lr, weight_decay=0.1, **flags)


VARIANTS = {
    "adamw": ("adamw", {}),
    "adamw_cautious": ("adamw", {"cautious": True}),
    "muon": ("muon", {}),
    "muon_plus": ("muon", {"muon_plus": True}),
    "muon_plus_cautious": ("muon", {"muon_plus": True, "cautious": True}),
    "muon_ns_bf16": ("muon", {"muon_ns_dtype": "bf16"}),
    "muon_ns_fp32": ("muon", {"muon_ns_dtype": "fp32"}),
}
STEP_VARIANTS = ("adamw", "adamw_cautious", "muon", "muon_plus", "muon_plus_cautious")
CONVERGENCE_VARIANTS = (
    "adamw",
    "adamw_cautious",
    "muon",
    "muon_plus",
    "muon_ns_bf16",
    "muon_ns_fp32",
)
PLOTTED = ("adamw", "adamw_cautious", "muon", "muon_plus")


def reference_model(args: argparse.Namespace) -> ReferenceTransformer:
    torch.manual_seed(0)
    return ReferenceTransformer(
        vocab_size=args.vocab, block_size=64, n_layer=args.layers, n_head=args.heads,
        n_kv_head=max(1, args.heads // 2), d_model=args.d_model,
    )  # fmt: skip


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value):
                total += value.numel() * value.element_size()
    return total


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fixed_grads(params: list[torch.Tensor], seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for param in params:
        param.grad = (torch.randn(param.shape, generator=generator) * 1e-2).to(param.device)


def bench_steps(args: argparse.Namespace, device: torch.device) -> dict:
    """Part 1: step time and state bytes per optimizer variant (steps interleaved)."""
    setups = {}
    for label in STEP_VARIANTS:
        name, flags = VARIANTS[label]
        model = reference_model(args).to(device)
        params = list(model.parameters())
        fixed_grads(params, 1)
        optimizer = build_optimizer(model, optimizer_config(name, 3e-4, **flags), device)
        optimizer.step()  # warm-up: allocates state
        setups[label] = (params, optimizer, flags)
    times: dict[str, list[float]] = {label: [] for label in setups}
    for step in range(args.steps):
        labels = list(setups)
        for label in labels[step % len(labels) :] + labels[: step % len(labels)]:
            optimizer = setups[label][1]
            sync(device)
            start = time.perf_counter()
            optimizer.step()
            sync(device)
            times[label].append(time.perf_counter() - start)
    results = {}
    for label, (params, optimizer, flags) in setups.items():
        param_bytes = sum(p.numel() * p.element_size() for p in params)
        results[label] = {
            "step_ms_median": 1e3 * statistics.median(times[label]),
            "state_bytes": state_bytes(optimizer),
            "param_bytes": param_bytes,
            "transient_copy_bytes": param_bytes if flags.get("cautious") else 0,
        }
        print(
            f"step  {label:<20} {results[label]['step_ms_median']:9.2f} ms   "
            f"state {results[label]['state_bytes'] / 2**20:7.2f} MiB"
        )
    return results


@contextlib.contextmanager
def torch_ns_in_fp32():
    """Patch torch.optim.Muon's Newton–Schulz to float32 (same precision as ours)."""
    module = sys.modules["torch.optim._muon"]
    original = module._zeropower_via_newtonschulz

    def fp32(grad, ns_coefficients, ns_steps, eps):
        a, b, c = ns_coefficients
        x = grad.float()
        tall = grad.size(0) > grad.size(1)
        if tall:
            x = x.T
        x = x / x.norm().clamp(min=eps)
        for _ in range(ns_steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        return x.T if tall else x

    module._zeropower_via_newtonschulz = fp32
    try:
        yield
    finally:
        module._zeropower_via_newtonschulz = original


def max_diff(params: dict[str, list[torch.Tensor]], other: str) -> float:
    """Largest absolute parameter difference between ours and ``other``."""
    pairs = zip(params["ours"], params[other], strict=True)
    return max((a.detach() - b.detach()).abs().max().item() for a, b in pairs)


def bench_muon_vs_torch(args: argparse.Namespace, device: torch.device) -> dict:
    """Part 2: ours vs torch.optim.Muon (bf16 NS) and vs torch with NS patched to fp32."""
    hyper = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True, "ns_steps": 5}
    shapes = [tuple(p.shape) for p in route_parameters(reference_model(args)).muon_params]

    def make_params():
        generator = torch.Generator().manual_seed(7)
        return [
            torch.nn.Parameter((torch.randn(s, generator=generator) * 0.02).to(device))
            for s in shapes
        ]

    peers = {"ours": (Muon, contextlib.nullcontext), "torch_bf16_ns": (torch.optim.Muon, None)}
    peers["torch_fp32_ns"] = (torch.optim.Muon, torch_ns_in_fp32)
    optimizers, params = {}, {}
    for label, (cls, _) in peers.items():
        params[label] = make_params()
        optimizers[label] = cls(params[label], **hyper)
    times = {label: [] for label in peers}
    total = max(args.muon_steps, args.fp32_steps)
    for step in range(total + 1):
        order = list(peers) if step % 2 == 0 else list(reversed(peers))
        for label in order:
            if label == "torch_bf16_ns" and step > args.muon_steps:
                continue  # the slow peer gets fewer steps; ours and fp32 keep going
            fixed_grads(params[label], 100 + step)
            context = peers[label][1]
            with context() if context is not None else contextlib.nullcontext():
                sync(device)
                start = time.perf_counter()
                optimizers[label].step()
                sync(device)
            if step > 0:  # step 0 is warm-up
                times[label].append(time.perf_counter() - start)
        if step == min(args.muon_steps, total):  # the bf16 peer's last step: same step count
            diff_bf16 = max_diff(params, "torch_bf16_ns")
    median = {label: statistics.median(values) for label, values in times.items()}
    best = {label: min(values) for label, values in times.items()}

    result = {
        "ours_ns_dtype": str(resolve_ns_dtype("auto", device)).removeprefix("torch."),
        "shapes": [list(s) for s in shapes],
        "steps": {label: len(values) + 1 for label, values in times.items()},  # + warm-up
        "hyper_parameters": hyper,
        "step_ms_median": {label: 1e3 * value for label, value in median.items()},
        "ratio_ours_vs_torch": median["ours"] / median["torch_bf16_ns"],
        "ratio_ours_vs_torch_fp32_ns": median["ours"] / median["torch_fp32_ns"],
        "step_ms_min": {label: 1e3 * value for label, value in best.items()},
        "ratio_ours_vs_torch_min": best["ours"] / best["torch_bf16_ns"],
        "ratio_ours_vs_torch_fp32_ns_min": best["ours"] / best["torch_fp32_ns"],
        "max_abs_param_diff_vs_torch_bf16": diff_bf16,
        "max_abs_param_diff_vs_torch_fp32": max_diff(params, "torch_fp32_ns"),
    }
    print(
        f"muon  ours (NS in {result['ours_ns_dtype']}) {result['step_ms_median']['ours']:.2f} ms"
        f" | torch.optim.Muon (bf16 NS) "
        f"{result['step_ms_median']['torch_bf16_ns']:.2f} ms | torch, NS patched to fp32 "
        f"{result['step_ms_median']['torch_fp32_ns']:.2f} ms"
    )
    print(
        f"ratio ours / torch.optim.Muon = {result['ratio_ours_vs_torch']:.3f}   "
        f"ours / torch(fp32 NS) = {result['ratio_ours_vs_torch_fp32_ns']:.3f}   (medians; "
        f"fastest steps: {result['ratio_ours_vs_torch_min']:.3f} / "
        f"{result['ratio_ours_vs_torch_fp32_ns_min']:.3f}; lower is faster)"
    )
    return result


def markov_batches(vocab: int, block: int, batch: int, count: int, seed: int) -> list[torch.Tensor]:
    """Token sequences from a fixed sparse random Markov chain (learnable, entropy ≈ ln 4)."""
    generator = torch.Generator().manual_seed(1234)
    successors = torch.randint(0, vocab, (vocab, 4), generator=generator)
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        tokens = torch.empty(batch, block, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=generator)
        for t in range(1, block):
            pick = torch.randint(0, 4, (batch,), generator=generator)
            tokens[:, t] = successors[tokens[:, t - 1], pick]
        batches.append(tokens)
    return batches


def train_once(name: str, flags: dict, lr: float, args, train, held_out) -> dict:
    torch.manual_seed(0)
    model = ReferenceTransformer(
        vocab_size=64, block_size=32, n_layer=2, n_head=4, n_kv_head=2, d_model=64
    )
    optimizer = build_optimizer(model, optimizer_config(name, lr, **flags), "cpu")
    losses = []
    for step in range(args.train_steps):
        ids = train[step % len(train)]
        optimizer.zero_grad(set_to_none=True)
        loss = model(ids[:, :-1], labels=ids[:, 1:])["loss"]
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        held = [model(ids[:, :-1], labels=ids[:, 1:])["loss"].item() for ids in held_out]
    return {"lr": lr, "losses": losses, "held_out_loss": statistics.mean(held)}


def bench_convergence(args: argparse.Namespace) -> dict:
    """Part 3: same data/seed/steps; lr sweep; best held-out loss per optimizer."""
    train = markov_batches(64, 33, 16, args.train_steps, seed=1)
    held_out = markov_batches(64, 33, 16, 4, seed=2)
    runs = {}
    for label in CONVERGENCE_VARIANTS:
        name, flags = VARIANTS[label]
        sweep = [train_once(name, flags, lr, args, train, held_out) for lr in args.lrs]
        best = min(sweep, key=lambda run: run["held_out_loss"])
        runs[label] = {
            "sweep": {str(run["lr"]): run["held_out_loss"] for run in sweep},
            "best_lr": best["lr"],
            "best_held_out_loss": best["held_out_loss"],
            "losses": best["losses"],
        }
        sweep_text = ", ".join(f"{run['lr']:g}: {run['held_out_loss']:.3f}" for run in sweep)
        print(f"conv  {label:<15} held-out loss by lr  {sweep_text}")
    return {"steps": args.train_steps, "entropy_floor": float(torch.log(torch.tensor(4.0))), **runs}


def plot(convergence: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label in PLOTTED:
        losses = torch.tensor(convergence[label]["losses"])
        smooth = torch.nn.functional.avg_pool1d(losses[None, None], 9, 1, 4, False, False)[0, 0]
        ax.plot(smooth.tolist(), label=f"{label} (lr {convergence[label]['best_lr']:g})")
    ax.axhline(convergence["entropy_floor"], color="grey", ls=":", label="entropy floor ln 4")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("train loss (9-step mean)")
    ax.set_title("Tiny reference transformer on a random Markov chain (CPU, seed 0)")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot  {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    parser.add_argument("--muon-steps", type=int, default=5, help="timed torch.optim.Muon steps")
    parser.add_argument("--fp32-steps", type=int, default=15, help="timed steps, ours/fp32 peer")
    parser.add_argument("--train-steps", type=int, default=150)
    parser.add_argument("--lrs", type=float, nargs="+", default=[3e-3, 1e-2, 3e-2])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--skip-convergence", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "bench/results/optimizers.json"))
    parser.add_argument("--plot", default=str(ROOT / "docs/img/optimizers_convergence.png"))
    args = parser.parse_args()
    if args.quick:
        args.d_model, args.layers, args.steps, args.muon_steps, args.fp32_steps = 64, 1, 3, 2, 3
        args.train_steps, args.lrs = 20, [3e-3]
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(
        f"cpu   capability {torch.backends.cpu.get_cpu_capability()}, native bf16 matmul "
        f"{cpu_has_native_bf16()}; muon_ns_dtype auto -> {resolve_ns_dtype('auto', device)} "
        f"on {device}"
    )
    results = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "device": str(device),
        "threads": args.threads,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_native_bf16": cpu_has_native_bf16(),
        "shape": {key: getattr(args, key) for key in ("d_model", "layers", "heads", "vocab")},
        "step": bench_steps(args, device),
        "muon_vs_torch": bench_muon_vs_torch(args, device),
    }
    if not args.skip_convergence:
        results["convergence"] = bench_convergence(args)
        if not args.quick:
            plot(results["convergence"], Path(args.plot))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"json  {out}")


if __name__ == "__main__":
    main()
