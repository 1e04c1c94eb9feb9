"""Training-side sections: run, model, data, optimizer, scheduler, precision, eval, runtime.

Each field is declared once: type, default, bounds and one line of help (the docs table and
the JSON Schema are generated from these declarations). ``__post_init__`` holds only the rules
that relate two fields; it runs at construction. As in 2.0.0, later assignments are not
re-validated (``SpeedtronicConfig.validate`` checks the whole again).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    ValidatorFunctionWrapHandler,
    model_validator,
)
from pydantic_core import ArgsKwargs

from speedtronic.config.fields import (
    CHOICE,
    FALSE_STRINGS,
    STEPS,
    TRUE_STRINGS,
    Bool,
    F,
    Float,
    Int,
    PathStr,
    Str,
    choice,
    describe,
    section,
)
from speedtronic.config.limits import DAY, MAX_SEED, MAX_STEPS, ConfigError, is_hub_repo_id

__all__ = [
    "SYNTHETIC_KINDS",
    "DataConfig",
    "EvalConfig",
    "ModelConfig",
    "OptimizerConfig",
    "PrecisionConfig",
    "RunConfig",
    "RuntimeConfig",
    "SchedulerConfig",
]

SYNTHETIC_KINDS = ("markov", "uniform", "none")
MAX_VOCAB = 2**24  # token ids must fit the embedding; uint32 token files allow more
MAX_SEQ_LEN = 2**20
SEED = {"ge": 0, "le": MAX_SEED}
BETA = Annotated[Float, Field(ge=0.0, lt=1.0)]


def _synthetic(value: object) -> object:
    """``data.synthetic``: YAML booleans keep working (true = markov, false = none)."""
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return "markov" if value else "none"
    text = choice(value)
    if isinstance(text, str) and text in TRUE_STRINGS | FALSE_STRINGS:
        return "markov" if text in TRUE_STRINGS else "none"
    return text


def _dataset(value: object) -> object:
    """``data.dataset``: a path string, or (in Python) a Dataset object."""
    plain = (bool, int, float, bytes, bytearray, Mapping, list, tuple, set, frozenset)
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, plain) or (
        not hasattr(value, "__getitem__") and not hasattr(value, "__iter__")
    ):
        raise ConfigError(f"data.dataset must be a path string or a Dataset, got {describe(value)}")
    return value


def _tokenizer(value: object) -> object:
    """``data.tokenizer`` without surrounding blanks; empty or any case of bytes is ``bytes``."""
    if not isinstance(value, str):
        return value
    return "bytes" if value.strip().lower() in ("", "bytes") else value.strip()


def _hub_repo(value: str | None) -> str | None:
    """A Hub model repo id, ``owner/name``."""
    if value is not None and not is_hub_repo_id(value):
        raise ValueError("must be a Hub repo id 'owner/name'")
    return value


def _auto(value: object) -> object:
    return "auto" if isinstance(value, str) and value.strip().lower() == "auto" else value


MUON_NS_DTYPES = ("auto", "bf16", "fp32")

NProc = Annotated[Annotated[Int, Field(gt=0, le=1024)] | Literal["auto"], BeforeValidator(_auto)]
HubRepo = Annotated[Str, AfterValidator(_hub_repo)]
Threads = Annotated[Annotated[Int, Field(gt=0, le=4096)] | Literal["auto"], BeforeValidator(_auto)]
DataParallel = Annotated[Literal["ddp", "fsdp"], CHOICE]
Dataset = Annotated[object, BeforeValidator(_dataset)]
Synthetic = Annotated[Literal["markov", "uniform", "none"], BeforeValidator(_synthetic)]
TokenDtype = Annotated[Literal["uint16", "uint32"], CHOICE]
Sampling = Annotated[Literal["random", "sequential"], CHOICE]
Tokenizer = Annotated[PathStr, BeforeValidator(_tokenizer)]
OptimizerName = Annotated[Literal["adamw", "muon"], CHOICE]
Betas = tuple[BETA, BETA]
NsDtype = Annotated[Literal["auto", "bf16", "fp32"], CHOICE]
SchedulerName = Annotated[Literal["cosine", "constant"], CHOICE]
PrecisionMode = Annotated[Literal["auto", "bf16", "fp16", "fp32"], CHOICE]
PrecisionDtype = Annotated[Literal["bf16", "fp16", "fp32"], CHOICE]
WINDOW = {"gt": 0, "le": MAX_SEQ_LEN}


@section("run")
class RunConfig:
    """What to run: name, seed, device, absolute optimizer-step target, output directory."""

    name: Str = F("speedtronic-run", "descriptive run name (never used in paths)")
    seed: Int = F(1234, "seeds Python, NumPy and torch; the default data.seed", **SEED)
    device: Str = F("auto", "auto (CUDA, then MPS, then CPU), cpu, cuda, cuda:N or mps")
    max_steps: Int = F(1000, "absolute optimizer-step target", **STEPS)
    output_dir: PathStr = F("runs", "base of every relative run path (relative to the CWD)")
    log_every: Int | None = F(None, "log cadence when logging.every_steps is 1", **STEPS)
    stop_on_nonfinite: Bool = F(True, "a NaN/inf loss stops the run (false: skip the update)")
    nproc_per_node: NProc = F(1, "ranks on this node: a count, or auto (the visible GPUs)")
    data_parallel: DataParallel = F("ddp", "ddp (replicas) or fsdp (sharded, FSDP2)")
    collective_timeout: Float = F(600.0, "seconds a collective waits for the ranks", gt=0, le=DAY)
    push_to_hub: HubRepo | None = F(None, "owner/name: after the run, push the model there")

    def __post_init__(self) -> None:
        self.device = self.device.strip()
        if not self.device:
            raise ConfigError("run.device must not be empty (use auto, cpu, cuda, cuda:N or mps)")


@section("model")
class ModelConfig:
    """Reference-transformer shape; every field is forwarded to the model factory."""

    name: Str = F("reference_transformer", "model registry key (checked when built)")
    init_from: Str | None = F(
        None, "start from a transformers Llama checkpoint: a folder or owner/name[@revision]"
    )
    vocab_size: Int = F(512, "vocabulary size", gt=0, le=MAX_VOCAB)
    max_seq_len: Int = F(128, "context length", gt=0, le=MAX_SEQ_LEN)
    n_layer: Int = F(4, "transformer blocks", gt=0, le=1024)
    n_head: Int = F(8, "attention heads; divides d_model", gt=0, le=1024)
    n_kv_head: Int | None = F(None, "key/value heads; null: n_head", gt=0, le=1024)
    d_model: Int = F(256, "residual width", gt=0, le=2**17)
    d_ff: Int | None = F(None, "MLP width; null: 4 * d_model", gt=0, le=2**20)
    dropout: Float = F(0.0, "dropout rate", ge=0.0, lt=1.0)
    tie_weights: Bool = F(True, "share embedding and output weights")
    rope_base: Float = F(10000.0, "RoPE base", gt=0, le=1e12)
    norm_eps: Float = F(1e-5, "RMSNorm epsilon (transformers' rms_norm_eps)", gt=0, le=0.1)
    gradient_checkpointing: Bool = F(False, "activation checkpointing (OR-ed with the root flag)")

    def __post_init__(self) -> None:
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model
        if self.n_head % self.n_kv_head != 0:
            raise ConfigError("model.n_head must be divisible by model.n_kv_head")
        if self.d_model % self.n_head != 0:
            raise ConfigError("model.d_model must be divisible by model.n_head")
        if self.init_from is not None:
            self.init_from = self.init_from.strip()
            if not self.init_from:
                raise ConfigError(
                    "model.init_from must be a folder or owner/name[@revision] (null: random "
                    "weights), got an empty string"
                )
            if self.name not in ("reference_transformer", "gpt"):
                raise ConfigError(
                    f"model.init_from loads a transformers Llama checkpoint into the reference "
                    f"transformer; model.name is {self.name!r} (use reference_transformer)"
                )

    @model_validator(mode="wrap")
    @classmethod
    def _remember_given(cls, values: object, handler: ValidatorFunctionWrapHandler) -> ModelConfig:
        """Record which fields the input named with a value (see :attr:`given`)."""
        section: ModelConfig = handler(values)
        if isinstance(values, cls):  # an instance revalidated inside the aggregate: keep its own
            return section
        named: dict[str, object] = {}
        if isinstance(values, Mapping):
            named.update(values)
        elif isinstance(values, ArgsKwargs):  # a constructor call
            named.update(values.kwargs or {})
            fields = [item.name for item in dataclasses.fields(cls)]
            named.update(zip(fields, values.args, strict=False))
        section.__dict__["_given"] = frozenset(k for k, v in named.items() if v is not None)
        return section

    @property
    def given(self) -> frozenset[str]:
        """The fields the configuration set (file, env, ``--set``, keywords); the others hold
        their defaults. ``model.init_from`` fills the shape fields not given from the
        checkpoint and refuses a given one that differs."""
        given: frozenset[str] = self.__dict__.get("_given", frozenset())
        return given


@section("data")
class DataConfig:
    """Where batches come from and how big they are.

    Source precedence: ``text_path`` > ``token_path`` > ``dataset`` > synthetic.
    ``num_tokens`` is the number of synthetic *samples* (2.0.0 naming).
    """

    text_path: PathStr | None = F(None, "UTF-8 text file, streamed through data.tokenizer")
    dataset: Dataset = F(None, "path of a torch.save'd Dataset (a Dataset object in Python)")
    synthetic: Synthetic = F("markov", "markov, uniform or none: data when no source is given")
    num_tokens: Int = F(100000, "number of synthetic samples", gt=0, le=10**8)
    vocab_size: Int | None = F(None, "informational; null: model.vocab_size", gt=0, le=MAX_VOCAB)
    block_size: Int | None = F(None, "tokens per sample; null: model.max_seq_len", **WINDOW)
    micro_batch_size: Int = F(1, "samples per forward/backward", gt=0, le=2**16)
    target_batch_size: Int = F(1, "samples per optimizer update", gt=0, le=2**24)
    num_workers: Int = F(0, "DataLoader workers", ge=0, le=256)
    prefetch_factor: Int | None = F(
        None, "DataLoader prefetch (null: 2 with workers)", gt=0, le=1024
    )
    pin_memory: Bool | None = F(None, "pin host memory (null: when the device is CUDA)")
    shuffle: Bool = F(False, "shuffle map-style datasets")
    drop_last: Bool = F(True, "drop the last incomplete batch")
    seed: Int | None = F(None, "data seed (Markov chain, held-out data); null: run.seed", **SEED)
    max_steps: Int | None = F(None, "when set, the run target instead of run.max_steps", **STEPS)
    token_path: PathStr | None = F(None, "pre-tokenized .bin/.npy file or a prepared folder")
    token_dtype: TokenDtype = F("uint16", "element type of a .bin token file")
    sampling: Sampling = F("random", "token-file windows: random or sequential")
    allow_pickle: Bool = F(False, "allow unpickling data.dataset (trusted files only)")
    tokenizer: Tokenizer = F("bytes", "bytes, a tokenizer.json path or folder, or a Hub repo id")

    def __post_init__(self) -> None:
        if self.target_batch_size < self.micro_batch_size:
            raise ConfigError("target_batch_size must be >= micro_batch_size")
        if self.target_batch_size % self.micro_batch_size != 0:
            raise ConfigError("target_batch_size must be divisible by micro_batch_size")

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer update (``target_batch_size // micro_batch_size``)."""
        return self.target_batch_size // self.micro_batch_size


@section("optimizer")
class OptimizerConfig:
    """Inner optimizer: ``adamw`` (all parameters) or ``muon`` (hidden matrices) + AdamW rest."""

    name: OptimizerName = F("adamw", "adamw (every parameter) or muon (hidden matrices)")
    lr: Float = F(0.0003, "learning rate (peak, after warmup)", gt=0, le=10.0)
    betas: Betas = F((0.9, 0.95), "AdamW betas: two values in [0, 1)")
    eps: Float = F(1e-8, "AdamW epsilon", gt=0, le=1.0)
    weight_decay: Float = F(0.1, "decoupled weight decay", ge=0, le=1000.0)
    fused: Bool | None = F(None, "fused AdamW: null probes, true tries, false is off")
    grad_clip: Float | None = F(None, "global grad-norm clip", gt=0, le=1e9)
    muon_plus: Bool = F(False, "Muon+ normalisation (only with name: muon)")
    cautious: Bool = F(False, "cautious update masking (either optimizer)")
    muon_momentum: Float = F(0.95, "Muon momentum", ge=0.0, lt=1.0)
    muon_ns_steps: Int = F(5, "Newton-Schulz iterations", gt=0, le=100)
    muon_norm_eps: Float = F(1e-8, "Muon normalisation epsilon", gt=0, le=1.0)
    muon_ns_dtype: NsDtype = F("auto", "Newton-Schulz working precision: auto, bf16 or fp32")

    def __post_init__(self) -> None:
        if self.muon_plus and self.name != "muon":
            raise ConfigError("optimizer.muon_plus is only valid with optimizer.name=muon")


@section("scheduler")
class SchedulerConfig:
    """Learning-rate schedule: linear warmup then cosine (or constant) up to ``max_steps``.

    ``max_steps: null`` (the default) follows the effective run target; the aggregate fills
    the number in and remembers it filled it (:attr:`max_steps_explicit` is then false).
    """

    name: SchedulerName = F("cosine", "cosine or constant after the warmup")
    warmup_steps: Int = F(100, "linear warmup steps", ge=0, le=MAX_STEPS)
    max_steps: Int | None = F(None, "cosine horizon; null: the run target", **STEPS)
    min_lr_ratio: Float = F(0.1, "final LR as a fraction of lr", ge=0.0, le=1.0)

    @property
    def max_steps_explicit(self) -> bool:
        """False while ``max_steps`` is unset or the value the aggregate filled in."""
        filled = self.__dict__.get("_filled_max_steps")
        return self.max_steps is not None and self.max_steps != filled


@section("precision")
class PrecisionConfig:
    """Autocast precision request; hardware fallbacks happen at runtime."""

    mode: PrecisionMode = F("auto", "autocast mode: auto, bf16, fp16 or fp32")
    dtype: PrecisionDtype | None = F(None, "bf16, fp16 or fp32; used only when mode is auto")


@section("eval")
class EvalConfig:
    """Held-out evaluation: the held-out source (one of ``text_path``, ``token_path``,
    ``holdout``), how often (``every_steps``; 0 = only at the end) and how many tokens."""

    text_path: PathStr | None = F(None, "held-out UTF-8 text file")
    token_path: PathStr | None = F(None, "held-out token file, or a prepared folder")
    holdout: Float = F(0.0, "fraction at the end of the training source", ge=0.0, lt=1.0)
    every_steps: Int = F(200, "eval cadence in optimizer steps (0: at the end)", ge=0, le=MAX_STEPS)
    tokens: Int = F(8192, "target tokens scored per eval", gt=0, le=2**31 - 1)
    batch_size: Int | None = F(
        None, "windows per forward; null: data.micro_batch_size", gt=0, le=2**16
    )

    def __post_init__(self) -> None:
        if self.text_path and self.token_path:
            raise ConfigError("eval.text_path and eval.token_path are exclusive; set one of them")
        if self.holdout > 0 and (self.text_path or self.token_path):
            raise ConfigError(
                "eval.holdout cannot be combined with eval.text_path/eval.token_path: hold out "
                "part of the training data or name a held-out file, not both"
            )

    @property
    def enabled(self) -> bool:
        """True when a held-out source is configured."""
        return bool(self.text_path or self.token_path or self.holdout > 0)


@section("runtime")
class RuntimeConfig:
    """How the process uses the CPU it was given (``speedtronic.train.threads``)."""

    threads: Threads = F(
        "auto", "torch threads: a count, or auto (CPUs allowed / processes on this host)"
    )
