"""``model.init_from``: start a run from a transformers checkpoint of the Llama family.

The inverse of :mod:`speedtronic.model.export`, through the same parameter-name table
(:func:`~speedtronic.model.export.llama_names`). What the reference transformer represents
exactly (logits equal to transformers' in fp32, measured in the tests):

* ``LlamaForCausalLM`` with no ``rope_scaling`` or ``rope_parameters`` other than
  ``rope_type: default``, no attention or MLP biases, ``hidden_act: silu``, ``head_dim`` =
  ``hidden_size / num_attention_heads``, and ``intermediate_size`` a multiple of
  ``num_attention_heads`` (the reference MLP rounds its width to the head count); its
  ``rms_norm_eps`` becomes ``model.norm_eps`` (transformers' default 1e-6 when absent);
* ``MistralForCausalLM`` under the same rules with ``sliding_window: null`` (then it is a Llama).

Everything else is refused with one line naming the architecture and the field that differs:
``Qwen2ForCausalLM`` always (its q/k/v projections have biases), a ``rope_scaling``, a
``sliding_window``, ... Two steps, both called by
:func:`speedtronic.train.runtime.build_runtime`:

1. :func:`resolve_init_from` (before the model is built) fetches the checkpoint
   (:mod:`speedtronic.model.hf_source`), reads ``config.json`` and fills the ``model`` section
   with its shape. A shape field the configuration set (:attr:`ModelConfig.given`) must agree:
   a different value is a ``ConfigError`` naming both. ``model.max_seq_len`` is the
   checkpoint's ``max_position_embeddings`` unless set (then it may only be smaller). The
   tokenizer is the checkpoint's (``data.tokenizer`` becomes its folder) unless
   ``data.tokenizer`` names another one. When the weight files are here, their safetensors
   headers (not their data) must hold every tensor in the shape ``config.json`` declares
   (:func:`speedtronic.model.sizes.check_stored`): a ``config.json`` declaring a huge model
   beside a small or broken weights file is refused before anything is allocated.
2. :func:`load_hf_weights` copies the weights into the built model tensor by tensor
   (``safetensors.safe_open``): beyond the model itself, at most one tensor is held at a time
   (``bench/init_from_memory.py`` measures it). A tensor holding NaN or inf is refused.

DiLoCo: the master loads the weights, so the global it publishes first (global 0, taken from
the model when the coordinator is built) is the checkpoint, bit for bit in fp32. A worker
fetches ``config.json`` and the tokenizer only and starts from global 0 (``weights=False``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from speedtronic.config import ConfigError, ModelConfig, SpeedtronicConfig
from speedtronic.json_types import JSON, JSONView
from speedtronic.model.hf_source import CONFIG, fetch_checkpoint, weight_files

if TYPE_CHECKING:
    from speedtronic.model.transformer import ReferenceTransformer

__all__ = [
    "SUPPORTED",
    "HFCheckpoint",
    "load_hf_weights",
    "reference_shape",
    "resolve_init_from",
]

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM")
_HF_RMS_EPS = 1e-6  # transformers' LlamaConfig / MistralConfig default for rms_norm_eps
_FIELD = "model.init_from"
# ModelConfig field -> the config.json key it comes from (for messages).
_HF_KEYS = {
    "vocab_size": "vocab_size",
    "n_layer": "num_hidden_layers",
    "n_head": "num_attention_heads",
    "n_kv_head": "num_key_value_heads",
    "d_model": "hidden_size",
    "d_ff": "intermediate_size",
    "tie_weights": "tie_word_embeddings",
    "rope_base": "rope_theta",
    "norm_eps": "rms_norm_eps",
    "max_seq_len": "max_position_embeddings",
}
_IGNORED_TENSORS = ("rotary_emb.inv_freq",)  # old checkpoints saved the RoPE table


@dataclasses.dataclass(frozen=True)
class HFCheckpoint:
    """A resolved ``model.init_from``: the local ``folder``, its architecture, whether this
    process loads its weights (a DiLoCo worker does not) and whether its tokenizer is used."""

    spec: str
    folder: Path
    architecture: str
    loads_weights: bool
    tokenizer: bool

    def describe(self) -> str:
        """One startup line."""
        source = "weights" if self.loads_weights else "shape only (weights from global 0)"
        tokenizer = ", its tokenizer" if self.tokenizer else ""
        return f"init_from {self.spec} ({self.architecture}): {source}{tokenizer}"


def _refuse(spec: str, architecture: str, field: str, value: object, why: str) -> ConfigError:
    return ConfigError(
        f"{_FIELD}: {spec} is a {architecture} with {field} = {json.dumps(value)}; {why}"
    )


def _mlp_width(d_ff: int, n_head: int) -> int:
    """The SwiGLU hidden width the reference model builds for ``d_ff`` (see ``SwiGLU``)."""
    hidden = int(int(d_ff) * (2 / 3))
    return n_head * math.ceil(hidden / n_head)


def _d_ff_for(width: int, n_head: int) -> int | None:
    """A ``d_ff`` whose reference MLP is ``width`` wide (None: there is none)."""
    middle = (3 * width) // 2  # the inverse of 2/3, tried first, then its neighbours
    for d_ff in (middle, middle + 1, middle - 1, middle + 2, middle - 2, middle + 3):
        if d_ff > 0 and _mlp_width(d_ff, n_head) == width:
            return d_ff
    return None


def _rope_theta(hf: JSONView, spec: str, architecture: str) -> float:
    """``rope_theta`` of a 4.x (``rope_scaling``) or 5.x (``rope_parameters``) config; either
    field (both may be there) naming a RoPE type other than ``default`` is refused."""
    for field in ("rope_parameters", "rope_scaling"):
        value = hf.get(field)
        kind = value
        if isinstance(value, Mapping):
            kind = value.get("rope_type") or value.get("type")
        if kind not in (None, "default"):
            why = "the reference model has plain RoPE only (no scaling)"
            raise _refuse(spec, architecture, field, value, why)
    parameters = hf.get("rope_parameters")
    theta = hf.get("rope_theta")
    if isinstance(parameters, Mapping):
        theta = parameters.get("rope_theta", theta)
    return float(theta or 10000.0)


def reference_shape(hf: JSONView, spec: str) -> JSON:
    """The ``model`` fields (``max_seq_len`` included) of a transformers ``config.json``, or a
    ``ConfigError`` naming the architecture and the field the reference model cannot match."""
    architecture = str((hf.get("architectures") or [hf.get("model_type") or "?"])[0])
    if architecture == "Qwen2ForCausalLM":
        raise _refuse(
            spec,
            architecture,
            "attention biases",
            True,
            "Qwen2's q/k/v projections have biases and the reference model has none",
        )
    if architecture not in SUPPORTED:
        raise ConfigError(
            f"{_FIELD}: {spec} is a {architecture}; supported: LlamaForCausalLM and "
            "MistralForCausalLM (with sliding_window: null)"
        )
    theta = _rope_theta(hf, spec, architecture)
    n_head, d_model = int(hf["num_attention_heads"]), int(hf["hidden_size"])
    width = int(hf["intermediate_size"])
    checks = (
        ("attention_bias", bool(hf.get("attention_bias", False)), "no biases"),
        ("mlp_bias", bool(hf.get("mlp_bias", False)), "no biases"),
        ("hidden_act", hf.get("hidden_act", "silu") != "silu", "a SiLU-gated MLP"),
        ("sliding_window", hf.get("sliding_window") is not None, "full causal attention"),
        ("use_sliding_window", bool(hf.get("use_sliding_window", False)), "full attention"),
        (
            "head_dim",
            int(hf.get("head_dim") or d_model // n_head) * n_head != d_model,
            "hidden / heads",
        ),
        ("intermediate_size", width % n_head != 0, "its MLP width rounded to the heads"),
    )
    for field, differs, ours in checks:
        if differs:
            raise _refuse(
                spec, architecture, field, hf.get(field), f"the reference model has {ours}"
            )
    d_ff = _d_ff_for(width, n_head)
    if d_ff is None:  # pragma: no cover - every multiple of n_head has one
        raise _refuse(spec, architecture, "intermediate_size", width, "no d_ff gives it")
    return {
        "vocab_size": int(hf["vocab_size"]),
        "n_layer": int(hf["num_hidden_layers"]),
        "n_head": n_head,
        "n_kv_head": int(hf.get("num_key_value_heads") or n_head),
        "d_model": d_model,
        "d_ff": d_ff,
        "tie_weights": bool(hf.get("tie_word_embeddings", False)),
        "rope_base": theta,
        "norm_eps": float(_HF_RMS_EPS if hf.get("rms_norm_eps") is None else hf["rms_norm_eps"]),
        "max_seq_len": int(hf.get("max_position_embeddings") or ModelConfig.max_seq_len),
    }


def _merge(section: ModelConfig, shape: JSONView, spec: str) -> ModelConfig:
    """``section`` with the checkpoint's shape; a given field that differs is a ConfigError."""
    values = {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}
    for field, theirs in shape.items():
        ours = values[field]
        if field not in section.given or ours == theirs:
            values[field] = theirs
            continue
        hf_key = _HF_KEYS[field]
        if field == "max_seq_len" and ours < theirs:
            continue  # a shorter training context than the checkpoint's is fine
        if field == "d_ff" and _mlp_width(ours, shape["n_head"]) == _mlp_width(
            theirs, shape["n_head"]
        ):
            values[field] = theirs
            continue
        shown = _mlp_width(theirs, shape["n_head"]) if field == "d_ff" else theirs
        bound = " at most" if field == "max_seq_len" else ""
        raise ConfigError(
            f"model.{field} is {ours} but {_FIELD} {spec} has {hf_key} {shown}; leave "
            f"model.{field} unset (the checkpoint sets it) or make it{bound} {theirs}"
        )
    try:
        return ModelConfig(**values)
    except ConfigError as exc:
        raise ConfigError(f"{_FIELD} {spec}: {exc}") from None


def _fit_block_size(config: SpeedtronicConfig, old_context: int, spec: str) -> None:
    """Samples no longer than the checkpoint's context: a ``data.block_size`` filled from the
    section's own ``max_seq_len`` (128 unset) follows the checkpoint's; a longer one given
    explicitly is a ``ConfigError`` (the model could not read it)."""
    context, block = config.model.max_seq_len, config.data.block_size
    if block is None or block <= context:
        return
    if block == old_context:
        config.data.block_size = context
        return
    raise ConfigError(
        f"data.block_size is {block} but model.init_from {spec} has max_position_embeddings "
        f"{context}; set data.block_size to at most {context}"
    )


def resolve_init_from(config: SpeedtronicConfig, *, weights: bool = True) -> HFCheckpoint | None:
    """Fill ``config.model`` (and ``data.tokenizer``) from ``model.init_from``, in place.

    None without ``model.init_from``; a section resolved before answers at once (the
    ``HFCheckpoint`` is kept on it). The weight files are fetched only with ``weights`` and
    not on a DiLoCo worker (it starts from the master's global 0); ``eval``/``export``/
    ``sample`` pass ``weights=False`` (they load a trained checkpoint). Raises ``ConfigError``
    for an unsupported checkpoint or a conflicting setting.
    """
    from speedtronic.config.tokenizer_file import is_bytes
    from speedtronic.retry import retry_policy_from_config

    spec = config.model.init_from
    if spec is None:
        return None
    done = _RESOLVED.get(id(config.model))  # resolved before: the section is its shape
    if done is not None and done.spec == spec and (done.loads_weights or not weights):
        return done
    distributed = config.distributed
    worker = distributed.enabled and distributed.node_role == "worker"
    weights = weights and not worker
    folder = fetch_checkpoint(
        spec, token=distributed.token, retry=retry_policy_from_config(distributed), weights=weights
    )
    try:
        hf = json.loads((folder / CONFIG).read_text(encoding="utf-8"))
        shape = reference_shape(hf, spec)
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{_FIELD}: {folder / CONFIG} is not a usable config ({exc!r})") from None
    old_vocab, old_context = config.model.vocab_size, config.model.max_seq_len
    config.model = _merge(config.model, shape, spec)
    if config.data.vocab_size == old_vocab:  # informational; filled from the old section
        config.data.vocab_size = config.model.vocab_size
    _check_headers(folder, config.model, spec)
    _fit_block_size(config, old_context, spec)
    tokenizer = is_bytes(config.data.tokenizer) and (folder / "tokenizer.json").is_file()
    if tokenizer:
        config.data.tokenizer = str(folder)
    config.validate()  # the tokenizer's ids must fit the checkpoint's vocabulary
    architecture = str((hf.get("architectures") or ["?"])[0])
    found = HFCheckpoint(spec, folder, architecture, weights, tokenizer)
    _remember(config.model, found)
    return found


#: The checkpoint each resolved model section came from, by the section's identity (an entry
#: goes with its section), so a second :func:`resolve_init_from` of it answers at once.
_RESOLVED: dict[int, HFCheckpoint] = {}


def _remember(section: ModelConfig, found: HFCheckpoint) -> None:
    key = id(section)
    if key not in _RESOLVED:
        weakref.finalize(section, _RESOLVED.pop, key, None)
    _RESOLVED[key] = found


def _check_headers(folder: Path, section: ModelConfig, spec: str) -> None:
    """The weight files' headers against the shapes ``section`` declares (when the files are
    here: a DiLoCo worker and ``validate`` of a Hub repo fetch none); nothing is allocated."""
    from safetensors import SafetensorError, safe_open

    from speedtronic.model.export import llama_names
    from speedtronic.model.sizes import check_stored

    try:
        files = weight_files(folder)
    except ConfigError:
        return  # fetch_checkpoint said so where the weights are needed
    if not all(path.is_file() for path in files):
        return
    ours = {v: k for k, v in llama_names(section.n_layer, section.tie_weights).items()}
    stored: dict[str, list[int]] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                for key in list(handle.keys()):
                    tied_head = key == "lm_head.weight" and section.tie_weights
                    if tied_head or key.endswith(_IGNORED_TENSORS):
                        continue
                    if key not in ours:
                        raise ConfigError(
                            f"{_FIELD}: {path.name} holds {key}, which the reference model has "
                            "no place for"
                        )
                    stored[ours[key]] = handle.get_slice(key).get_shape()
        except (SafetensorError, OSError) as exc:
            raise ConfigError(
                f"{_FIELD}: {path} is not a readable safetensors file ({exc})"
            ) from None
    _refuse_missing(folder, sorted(theirs for theirs, mine in ours.items() if mine not in stored))
    if section.tie_weights and "transformer.wte.weight" in stored:
        stored["lm_head.weight"] = stored["transformer.wte.weight"]  # one matrix, two names
    names = ", ".join(path.name for path in files)
    check_stored(section, stored, f"{_FIELD} {spec} ({names} against {CONFIG})", reference=True)


@torch.no_grad()
def load_hf_weights(model: ReferenceTransformer, checkpoint: HFCheckpoint | str | Path) -> int:
    """Copy a checkpoint's weights into the reference ``model`` (built from the resolved
    section) one tensor at a time; returns the number of tensors copied.

    Every reference parameter must be filled exactly once with its shape; a tensor the
    reference model has no place for (a bias, say) is a ``ConfigError``. The file's dtype is
    converted to the model's (bf16 -> fp32 is exact).
    """
    from safetensors import safe_open

    from speedtronic.checkpoint import non_finite
    from speedtronic.model.export import llama_names

    folder = checkpoint.folder if isinstance(checkpoint, HFCheckpoint) else Path(checkpoint)
    cfg = model.config
    ours_by_theirs = {v: k for k, v in llama_names(cfg.n_layer, cfg.tie_weights).items()}
    targets = model.state_dict()  # tensors sharing the parameters' storage
    done: set[str] = set()
    for path in weight_files(folder):
        with safe_open(str(path), framework="pt") as handle:
            names = list(handle.keys())
        for key in names:
            if key.endswith(_IGNORED_TENSORS) or (key == "lm_head.weight" and cfg.tie_weights):
                continue  # a tied head is the embedding: transformers ignores it too
            ours = ours_by_theirs.get(key)
            if ours is None:
                raise ConfigError(
                    f"{_FIELD}: {path.name} holds {key}, which the reference model has no place for"
                )
            target = targets[ours]
            # Opened per tensor: the file is memory-mapped, and the pages one tensor touched
            # leave the process with the handle, so they never add up to the whole file.
            with safe_open(str(path), framework="pt") as handle:
                tensor = handle.get_tensor(key)
            if non_finite({key: tensor}) is not None:  # 16 K values at a time
                raise ConfigError(f"{_FIELD}: {path}: {key} holds NaN or inf values")
            if tuple(tensor.shape) != tuple(target.shape):
                raise ConfigError(
                    f"{_FIELD}: {path.name}: {key} has shape {tuple(tensor.shape)}, "
                    f"config.json makes it {tuple(target.shape)}"
                )
            target.copy_(tensor)
            del tensor
            done.add(key)
    _refuse_missing(folder, sorted(set(ours_by_theirs) - done))
    return len(done)


def _refuse_missing(folder: Path, missing: list[str]) -> None:
    """A ``ConfigError`` naming the (transformers) tensors a checkpoint lacks, if any."""
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ConfigError(f"{_FIELD}: {folder} lacks {', '.join(missing[:3])}{more}")
