"""Reference transformer vs transformers' LlamaForCausalLM of the same shape.

Both models are built in this process from config objects (random init, nothing is
downloaded) with identical shapes: d_model, layers, heads, KV heads, SwiGLU width, vocab,
RoPE base, RMSNorm eps, tied embeddings, no biases, SDPA attention. Each timed round runs
``--steps`` forward + backward passes (cross-entropy over all positions) of one model, then
the other, alternating which goes first; tokens/s is the median over rounds.

    python bench/model_vs_transformers.py                 # small CPU shape
    python bench/model_vs_transformers.py --preset 10m --device cuda --dtype bf16

Without ``transformers`` installed it prints a skip message and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from speedtronic.model import ReferenceTransformer
from speedtronic.model.export import llama_state_dict

PRESETS = {
    "tiny": {"vocab_size": 512, "d_model": 128, "n_layer": 2, "n_head": 4, "n_kv_head": 2},
    "small": {"vocab_size": 2048, "d_model": 256, "n_layer": 4, "n_head": 8, "n_kv_head": 2},
    "10m": {"vocab_size": 8192, "d_model": 384, "n_layer": 6, "n_head": 6, "n_kv_head": 2},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5, help="forward+backward passes per round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--out", default="bench/results/model_vs_transformers.json")
    return parser.parse_args(argv)


def build_pair(shape: dict, seq_len: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Return (reference, llama) with the same architecture and parameter count."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    ours = ReferenceTransformer(block_size=seq_len, tie_weights=True, **shape)
    hidden = ours.transformer.h[0].mlp.gate_proj.out_features
    config = LlamaConfig(
        vocab_size=shape["vocab_size"],
        hidden_size=shape["d_model"],
        intermediate_size=hidden,
        num_hidden_layers=shape["n_layer"],
        num_attention_heads=shape["n_head"],
        num_key_value_heads=shape["n_kv_head"],
        max_position_embeddings=seq_len,
        rms_norm_eps=1e-5,
        rope_theta=ours.config.rope_base,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        use_cache=False,
    )
    config._attn_implementation = "sdpa"
    llama = LlamaForCausalLM(config)
    return ours, llama


def copy_weights(ours: torch.nn.Module, llama: torch.nn.Module) -> None:
    """Load the reference model's weights into the Llama model (the export's name map)."""
    llama.load_state_dict(llama_state_dict(ours), strict=False)


@torch.no_grad()
def max_logit_difference(ours: torch.nn.Module, llama: torch.nn.Module, inputs) -> float:
    """Same weights in both models -> the largest absolute logit difference (fp32, eval)."""
    copy_weights(ours, llama)
    ours.eval(), llama.eval()
    a = ours(inputs)["logits"]
    b = llama(input_ids=inputs, use_cache=False).logits
    ours.train(), llama.train()
    return float((a - b).abs().max())


def make_step(name: str, model: torch.nn.Module, inputs, labels, autocast):
    vocab = model.config.vocab_size

    def step() -> None:
        with autocast():
            if name == "speedtronic":
                loss = model(inputs, labels=labels)["loss"]
            else:
                logits = model(input_ids=inputs, use_cache=False).logits
                loss = F.cross_entropy(logits.reshape(-1, vocab).float(), labels.reshape(-1))
        loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import transformers
    except ImportError:
        print("skip: transformers is not installed (pip install transformers); nothing measured")
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    shape = PRESETS[args.preset]
    ours, llama = build_pair(shape, args.seq_len)
    counts = {
        "speedtronic": sum(p.numel() for p in ours.parameters()),
        "transformers_llama": sum(p.numel() for p in llama.parameters()),
    }
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(shape["vocab_size"], (args.batch_size, args.seq_len + 1), generator=g)
    diff = max_logit_difference(ours, llama, tokens[:2, :-1])
    inputs, labels = tokens[:, :-1].to(device), tokens[:, 1:].to(device)

    def autocast():
        if args.dtype == "bf16":
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return nullcontext()

    steps = {}
    for name, model in (("speedtronic", ours), ("transformers_llama", llama)):
        model.to(device).train()
        steps[name] = make_step(name, model, inputs, labels, autocast)
        for _ in range(args.warmup):
            steps[name]()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    per_round: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps)
    for round_index in range(args.rounds):
        for name in order if round_index % 2 == 0 else reversed(order):
            sync()
            start = time.perf_counter()
            for _ in range(args.steps):
                steps[name]()
            sync()
            elapsed = time.perf_counter() - start
            per_round[name].append(args.batch_size * args.seq_len * args.steps / elapsed)

    tps = {name: statistics.median(values) for name, values in per_round.items()}
    ratio = tps["speedtronic"] / tps["transformers_llama"]
    paired = statistics.median(
        a / b
        for a, b in zip(per_round["speedtronic"], per_round["transformers_llama"], strict=True)
    )
    result = {
        "benchmark": "model_vs_transformers",
        "preset": args.preset,
        "shape": {**shape, "seq_len": args.seq_len, "batch_size": args.batch_size},
        "device": str(device),
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "steps_per_round": args.steps,
        "rounds": args.rounds,
        "parameters": counts,
        "max_abs_logit_difference_same_weights": diff,
        "tokens_per_sec": tps,
        "tokens_per_sec_rounds": per_round,
        "ratio_speedtronic_over_transformers": ratio,
        "ratio_median_of_paired_rounds": paired,
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
    }
    print(
        f"{args.preset} on {device} ({args.dtype}), {counts['speedtronic']:,} params "
        f"(llama {counts['transformers_llama']:,}), B={args.batch_size} T={args.seq_len}; "
        f"same weights -> max |logit diff| {diff:.2e}"
    )
    for name, value in tps.items():
        print(f"  {name:20s} {value:12,.0f} tokens/s (forward+backward)")
    print(f"  ratio speedtronic / transformers = {ratio:.3f} (paired rounds: {paired:.3f})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + os.linesep)
    print(f"  wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
