"""Memory of ``model.init_from`` (issue 32, item 1): what loading a transformers checkpoint
adds on top of the model itself, over the model's fp32 bytes. Bound: 1.3.

The loader opens the file once per tensor, so beyond the model it holds one tensor (in the
file's dtype) and that tensor's mapped pages; the peer holds every tensor of a file at once.

A Llama checkpoint of the reference shape is written here (``config.json`` + safetensors with
transformers' names, no transformers needed), as one fp32 file, as fp32 shards, and as one bf16
file. Each row runs in a fresh child process: it resolves ``model.init_from`` and builds the
model, takes its resident set as the baseline, resets the peak (``/proc/self/clear_refs``),
loads, and reports the new peak (``VmHWM``) minus the baseline. The peer, measured in the same
run on the same files, is the obvious loader: ``safetensors.torch.load_file`` of every file
(the whole state dict at once) then ``load_state_dict``.

    python bench/init_from_memory.py                         # ~41M parameters, ~1 minute
    python bench/init_from_memory.py --d-model 256 --layers 2 --vocab 8000   # quick
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from speedtronic.config import ModelConfig  # noqa: E402
from speedtronic.model import build_model  # noqa: E402
from speedtronic.model.export import llama_names  # noqa: E402

_CHILD = r"""
import json, re, sys, time
from pathlib import Path
sys.path.insert(0, {root!r})
import torch
from speedtronic.config import SpeedtronicConfig
from speedtronic.model import build_model
from speedtronic.model.export import llama_names
from speedtronic.model.hf_import import load_hf_weights, resolve_init_from
from speedtronic.model.hf_source import weight_files

folder, how = sys.argv[1], sys.argv[2]
def kib(field):
    return int(re.search(field + r":\s*(\d+) kB", Path("/proc/self/status").read_text()).group(1))

config = SpeedtronicConfig.from_dict({{"model": {{"init_from": folder}}}})
checkpoint = resolve_init_from(config)
model = build_model(config.model)
model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied: once
baseline = kib("VmRSS")
Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
started = time.perf_counter()
if how == "ours":
    load_hf_weights(model, checkpoint)
else:  # the peer: every file at once, then load_state_dict
    from safetensors.torch import load_file
    state = {{}}
    for path in weight_files(Path(folder)):
        state.update(load_file(str(path)))
    theirs = llama_names(model.config.n_layer, model.config.tie_weights)
    model.load_state_dict({{ours: state[name] for ours, name in theirs.items()}}, strict=False)
    del state
seconds = time.perf_counter() - started
probe = model.transformer.h[0].attn.q_proj.weight
print(json.dumps({{"extra_bytes": (kib("VmHWM") - baseline) * 1024, "model_bytes": model_bytes,
                  "seconds": seconds, "probe": float(probe.double().sum())}}))
"""


def write_checkpoint(folder: Path, section: ModelConfig, dtype: torch.dtype, shards: int) -> int:
    """A Llama-named copy of a random reference model; returns the bytes written."""
    torch.manual_seed(0)
    model = build_model(section)
    names = llama_names(section.n_layer, section.tie_weights)
    state = model.state_dict()
    tensors = {theirs: state[ours].to(dtype).contiguous().clone() for ours, theirs in names.items()}
    del model, state
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": section.vocab_size,
        "hidden_size": section.d_model,
        "intermediate_size": int(tensors["model.layers.0.mlp.gate_proj.weight"].shape[0]),
        "num_hidden_layers": section.n_layer,
        "num_attention_heads": section.n_head,
        "num_key_value_heads": section.n_kv_head,
        "max_position_embeddings": section.max_seq_len,
        "rms_norm_eps": 1e-5,
        "rope_theta": section.rope_base,
        "tie_word_embeddings": section.tie_weights,
        "hidden_act": "silu",
    }
    (folder / "config.json").write_text(json.dumps(config))
    names_in_order = list(tensors)
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"), {"format": "pt"})
    else:
        weight_map = {}
        per = -(-len(names_in_order) // shards)
        for i in range(shards):
            part = names_in_order[i * per : (i + 1) * per]
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            save_file({k: tensors[k] for k in part}, str(folder / file), {"format": "pt"})
            weight_map.update(dict.fromkeys(part, file))
        index = {"metadata": {}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def measure(folder: Path, how: str) -> dict:
    """One child process: the load's peak above the built model (see the module docstring)."""
    done = subprocess.run(
        [sys.executable, "-c", _CHILD.format(root=str(REPO)), str(folder), how],
        capture_output=True,
        text=True,
        check=True,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--bound", type=float, default=1.3)
    parser.add_argument(
        "--output", default=str(REPO / "bench" / "results" / "init_from_memory.json")
    )
    args = parser.parse_args(argv)
    section = ModelConfig(
        vocab_size=args.vocab,
        max_seq_len=256,
        n_layer=args.layers,
        n_head=args.heads,
        n_kv_head=args.kv_heads,
        d_model=args.d_model,
        tie_weights=False,
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, dtype, shards in (
            ("fp32, one file", torch.float32, 1),
            ("fp32, 4 shards", torch.float32, 4),
            ("bf16, one file", torch.bfloat16, 1),
        ):
            folder = Path(tmp) / label.replace(", ", "-").replace(" ", "")
            file_bytes = write_checkpoint(folder, section, dtype, shards)
            ours, peer = measure(folder, "ours"), measure(folder, "peer")
            assert ours["probe"] == peer["probe"], "the two loaders disagree"
            model_bytes = ours["model_bytes"]
            row = {
                "checkpoint": label,
                "file_bytes": file_bytes,
                "model_bytes": model_bytes,
                "ours_extra_bytes": ours["extra_bytes"],
                "peer_extra_bytes": peer["extra_bytes"],
                "ours_ratio": ours["extra_bytes"] / model_bytes,
                "peer_ratio": peer["extra_bytes"] / model_bytes,
                "ours_vs_peer": ours["extra_bytes"] / max(1, peer["extra_bytes"]),
                "ours_seconds": ours["seconds"],
                "peer_seconds": peer["seconds"],
            }
            rows.append(row)
            print(
                f"{label:15s} model {model_bytes / 2**20:7.1f} MiB  init_from +"
                f"{row['ours_extra_bytes'] / 2**20:6.1f} MiB = {row['ours_ratio']:.2f}x  "
                f"(load_file + load_state_dict +{row['peer_extra_bytes'] / 2**20:6.1f} MiB = "
                f"{row['peer_ratio']:.2f}x; ours/peer {row['ours_vs_peer']:.2f}, "
                f"{row['ours_seconds']:.2f} s vs {row['peer_seconds']:.2f} s)"
            )
    worst = max(row["ours_ratio"] for row in rows)
    result = {
        "bench": "init_from_memory",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "shape": vars(args),
        "parameters": rows[0]["model_bytes"] // 4,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "bound": args.bound,
        "worst_ratio": worst,
        "passed": worst <= args.bound,
        "rows": rows,
    }
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"worst init_from ratio {worst:.2f}x (bound {args.bound}x) -> {output}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
