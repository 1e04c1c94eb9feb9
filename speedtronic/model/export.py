"""``speedtronic export --format hf``: the reference transformer as a transformers Llama folder.

The reference transformer (pre-norm RMSNorm blocks, rotary embeddings in the rotate-half
layout, grouped-query SDPA attention, SwiGLU MLP, no biases) is architecturally a
``LlamaForCausalLM``; only parameter names differ (:data:`LLAMA_NAMES`). The folder holds

* ``config.json`` (written by ``transformers.LlamaConfig`` of the installed version),
* ``model.safetensors`` (fp32 as trained; tied embeddings stored once, as transformers does),
* ``tokenizer.json`` + ``tokenizer_config.json`` when the run used a ``data.tokenizer`` file
  (the byte-level tokenizer has no transformers equivalent: no tokenizer files then); its
  post-processor puts the end-of-text token before a text, as ``speedtronic sample`` puts it
  before a prompt, so ``generate`` on ``AutoTokenizer(prompt)`` sees the same ids,
* ``speedtronic.json``: provenance (weights source, step, outer step, redacted config).

so ``AutoModelForCausalLM.from_pretrained(DIR)`` / ``AutoTokenizer.from_pretrained(DIR)`` load
it. Every file gets one mode (``0666 & ~umask``: 0644 under the usual umask). A model with
no Llama equivalent (a registered custom model) is an :class:`ExportError`, never a wrong
file. The folder is assembled beside ``DIR`` and renamed into place, so ``DIR`` is either the
previous export or the complete new one. ``transformers`` is imported lazily.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from speedtronic.config import ModelConfig
from speedtronic.json_types import JSON

if TYPE_CHECKING:
    from transformers import LlamaConfig

    from speedtronic.data.tokenizer import HFTokenizer, Tokenizer
    from speedtronic.model.transformer import ReferenceTransformer

__all__ = [
    "LLAMA_NAMES",
    "ExportError",
    "check_exportable",
    "export_hf",
    "llama_names",
    "llama_state_dict",
    "verify_export",
]

# Reference-transformer block parameter -> Llama block parameter (both end in ``.weight``).
LLAMA_NAMES = {
    "ln1": "input_layernorm",
    "ln2": "post_attention_layernorm",
    "attn.q_proj": "self_attn.q_proj",
    "attn.k_proj": "self_attn.k_proj",
    "attn.v_proj": "self_attn.v_proj",
    "attn.out_proj": "self_attn.o_proj",
    "mlp.gate_proj": "mlp.gate_proj",
    "mlp.up_proj": "mlp.up_proj",
    "mlp.down_proj": "mlp.down_proj",
}


def llama_names(n_layer: int, tie_weights: bool) -> dict[str, str]:
    """Every reference-transformer parameter name -> its Llama name, for ``n_layer`` blocks.

    The one table both directions use: the exporter reads it as is, the importer
    (:mod:`speedtronic.model.hf_import`) inverts it. With tied embeddings ``lm_head.weight``
    is left out (transformers stores the shared matrix once, as ``embed_tokens``).
    """
    names = {
        "transformer.wte.weight": "model.embed_tokens.weight",
        "transformer.ln_f.weight": "model.norm.weight",
    }
    if not tie_weights:
        names["lm_head.weight"] = "lm_head.weight"
    for i in range(n_layer):
        for ours, theirs in LLAMA_NAMES.items():
            names[f"transformer.h.{i}.{ours}.weight"] = f"model.layers.{i}.{theirs}.weight"
    return names


class ExportError(ValueError):
    """The model or the output folder cannot be exported as asked (CLI exit 2)."""


def _transformers() -> ModuleType:
    try:
        import transformers
    except ImportError:
        raise ExportError(
            "export --format hf needs the transformers package: pip install transformers "
            "(or pip install 'speedtronic[bench]')"
        ) from None
    return transformers


def check_exportable(model_config: ModelConfig) -> None:
    """Refuse early (before any weights are read) a ``model.name`` without a Llama form."""
    from speedtronic.model.registry import registry
    from speedtronic.model.transformer import ReferenceTransformer

    name = model_config.name
    factory = registry.get(name) if name in registry else None
    if factory is not ReferenceTransformer:
        raise ExportError(
            f"model.name {name!r} has no Llama equivalent; export --format hf supports the "
            "built-in reference_transformer (alias gpt) only"
        )


def _reference_model(model: torch.nn.Module, name: str) -> ReferenceTransformer:
    from speedtronic.model.transformer import ReferenceTransformer

    if not isinstance(model, ReferenceTransformer):
        raise ExportError(
            f"model.name {name!r} ({type(model).__name__}) has no Llama equivalent; export "
            "--format hf supports the built-in reference_transformer (alias gpt) only"
        )
    return model


def llama_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Llama names -> contiguous fp32 copies of the reference model's weights.

    With tied embeddings ``lm_head.weight`` is left out (transformers ties it on load).
    """
    source = model.state_dict()
    names = llama_names(len(model.transformer.h), bool(model.config.tie_weights))
    mapped = {theirs: source[ours] for ours, theirs in names.items()}
    return {k: v.detach().to("cpu", torch.float32).contiguous().clone() for k, v in mapped.items()}


def _llama_config(model: ReferenceTransformer, eos_id: int | None) -> LlamaConfig:
    cfg = model.config
    gate = model.get_submodule("transformer.h.0.mlp.gate_proj")
    assert isinstance(gate, torch.nn.Linear)
    config: LlamaConfig = _transformers().LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=gate.out_features,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_kv_head,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.block_size,
        rms_norm_eps=float(cfg.norm_eps),
        rope_theta=float(cfg.rope_base),
        tie_word_embeddings=bool(cfg.tie_weights),
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=None,
    )
    config.architectures = ["LlamaForCausalLM"]
    # transformers 5 calls it dtype, 4.x torch_dtype (5 warns about the old name).
    setattr(config, "dtype" if hasattr(config, "dtype") else "torch_dtype", "float32")
    return config


def _bos_processor(document: JSON, eos_token: str, eos_id: int) -> JSON:
    """``document`` (a ``tokenizer.json``) whose post-processor puts the end-of-text token
    before every text, as ``speedtronic sample`` does (a prompt starts a new document). A
    ``ByteLevel`` post-processor (offsets only) is kept in front of it; one that adds tokens
    of its own (a template, BERT, RoBERTa) is replaced: training never added them."""
    template = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": eos_token, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [
            {"SpecialToken": {"id": eos_token, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": eos_token, "type_id": 1}},
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {eos_token: {"id": eos_token, "ids": [eos_id], "tokens": [eos_token]}},
    }
    current = document.get("post_processor")
    if isinstance(current, dict) and current.get("type") == "ByteLevel":
        template = {"type": "Sequence", "processors": [current, template]}
    return {**document, "post_processor": template}


def _write_tokenizer(tokenizer: HFTokenizer, folder: Path, max_seq_len: int) -> None:
    """``tokenizer.json`` + ``tokenizer_config.json``: ``AutoTokenizer`` encodes a text as
    ``speedtronic sample`` encodes a prompt (the end-of-text token first, when there is one)."""
    document = json.loads(tokenizer.info.path.read_text(encoding="utf-8"))
    config: JSON = {}
    if tokenizer.info.config_path is not None:
        loaded = json.loads(tokenizer.info.config_path.read_text(encoding="utf-8"))
        config = loaded if isinstance(loaded, dict) else {}
    config.update(
        tokenizer_class="PreTrainedTokenizerFast",  # exactly tokenizer.json, nothing added
        model_max_length=int(max_seq_len),
        clean_up_tokenization_spaces=False,
    )
    eos_token, eos_id = tokenizer.eos_token, tokenizer.eos_id
    if eos_token is not None and eos_id is not None:
        document = _bos_processor(document, eos_token, int(eos_id))
        config.update(eos_token=eos_token, bos_token=eos_token, add_bos_token=True)
    config["add_eos_token"] = False
    (folder / "tokenizer.json").write_text(json.dumps(document, ensure_ascii=False))
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _prepare_output(output: Path, overwrite: bool) -> Path:
    if output.exists() and not output.is_dir():
        raise ExportError(f"--output {output} is a file, expected a folder")
    if output.is_dir() and any(output.iterdir()) and not overwrite:
        raise ExportError(
            f"--output {output} is not empty; pass --overwrite to replace it or choose "
            "another folder"
        )
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = output.with_name(f".{output.name}.export-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    return staging


def export_hf(
    model: torch.nn.Module,
    output: str | os.PathLike[str],
    *,
    model_name: str = "reference_transformer",
    tokenizer: Tokenizer | None = None,
    provenance: JSON | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``model`` as a transformers Llama folder at ``output``; returns the folder.

    ``tokenizer``: an ``HFTokenizer`` whose files go along (``None`` or the byte tokenizer:
    none). ``provenance`` lands in ``speedtronic.json``. Raises :class:`ExportError` for a
    model without a Llama equivalent, a missing transformers, or a non-empty ``output``
    without ``overwrite``.
    """
    from safetensors.torch import save_file

    from speedtronic.data.tokenizer import HFTokenizer

    reference = _reference_model(model, model_name)
    output = Path(output)
    files = tokenizer if isinstance(tokenizer, HFTokenizer) else None
    eos_id = files.eos_id if files is not None else None
    config = _llama_config(reference, eos_id)
    staging = _prepare_output(output, overwrite)
    try:
        config.save_pretrained(staging)
        save_file(llama_state_dict(reference), str(staging / "model.safetensors"), {"format": "pt"})
        if files is not None:
            _write_tokenizer(files, staging, reference.config.block_size)
        record = {"format": "hf-llama", **(provenance or {})}
        (staging / "speedtronic.json").write_text(json.dumps(record, indent=2, default=str))
        _one_mode(staging)
        _swap_into_place(staging, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return output


def _umask() -> int:
    """The process umask (read from /proc where it can be, so it is never changed)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    current = os.umask(0o022)
    os.umask(current)
    return current


def _one_mode(folder: Path) -> None:
    """Every exported file ``0666 & ~umask`` (0644 usually) and the folder ``0777 & ~umask``:
    writers differ (safetensors creates its file 0600), the export should not."""
    mask = _umask()
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~mask)
    folder.chmod(0o777 & ~mask)


def _swap_into_place(staging: Path, output: Path) -> None:
    previous = None
    if output.exists():
        previous = output.with_name(f".{output.name}.previous-{os.getpid()}")
        os.replace(output, previous)
    os.replace(staging, output)
    if previous is not None:
        shutil.rmtree(previous, ignore_errors=True)


@torch.no_grad()
def verify_export(model: torch.nn.Module, folder: str | os.PathLike[str], seed: int = 0) -> float:
    """Load ``folder`` with transformers and return the max |logit difference| against
    ``model`` on a random (2, T) batch, both in fp32 on CPU."""
    transformers = _transformers()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).float().eval()
    cfg = model.config
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randint(cfg.vocab_size, (2, min(cfg.block_size, 64)), generator=generator)
    reference = model.to("cpu", torch.float32).eval()
    ours = reference(inputs)["logits"]
    theirs = loaded(input_ids=inputs).logits
    return float((ours - theirs).abs().max())
