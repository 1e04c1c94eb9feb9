"""Training-side section dataclasses: run, model, data, optimizer, scheduler, precision.

Each section is a plain mutable ``@dataclass`` that coerces and validates its own fields in
``__post_init__`` (so direct Python construction is validated too); nothing re-validates after
later attribute mutation. Range-check messages are the 2.0.0 texts (reference/config.md §5);
type errors name the field and the expected type (see :mod:`speedtronic.config.coercion`).
Every numeric field also has an upper bound (:mod:`speedtronic.config.limits`), so nothing
absurd validates and fails later; docs/configuration.md lists the ranges.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from speedtronic.config.coercion import (
    FALSE_STRINGS,
    TRUE_STRINGS,
    describe,
    to_bool,
    to_float,
    to_int,
    to_path,
    to_str,
)
from speedtronic.config.errors import ConfigError
from speedtronic.config.limits import MAX_SEED, MAX_STEPS, at_most, blame, in_range

__all__ = [
    "SYNTHETIC_KINDS",
    "DataConfig",
    "EvalConfig",
    "ModelConfig",
    "OptimizerConfig",
    "PrecisionConfig",
    "RunConfig",
    "SchedulerConfig",
]


def _choice(value: Any, field: str, choices: tuple[str, ...], message: str) -> str:
    """Lower-case a string choice and check membership (non-strings fail with ``message``)."""
    if isinstance(value, bool) or value is None or not isinstance(value, (str, int, float)):
        raise ConfigError(f"{message}, got {describe(value)}")
    text = str(value).strip().lower()
    if text not in choices:
        raise ConfigError(message)
    return text


SYNTHETIC_KINDS = ("markov", "uniform", "none")
MAX_VOCAB = 2**24  # token ids must fit the embedding; uint32 token files allow more
MAX_SEQ_LEN = 2**20


def _synthetic_kind(value: Any) -> str:
    """``data.synthetic``: ``markov|uniform|none``; booleans keep working (true = markov)."""
    message = "data.synthetic must be markov, uniform or none (true means markov, false means none)"
    if isinstance(value, bool):
        return "markov" if value else "none"
    if isinstance(value, int) and value in (0, 1):
        return "markov" if value else "none"
    if not isinstance(value, str):
        raise ConfigError(f"{message}, got {describe(value)}")
    text = value.strip().lower()
    if text in TRUE_STRINGS:
        return "markov"
    if text in FALSE_STRINGS:
        return "none"
    if text not in SYNTHETIC_KINDS:
        raise ConfigError(f"{message}, got {describe(value)}")
    return text


def _dataset_like(value: Any) -> bool:
    """A programmatic Dataset object: indexable or iterable, but not a plain YAML value."""
    plain = (bool, int, float, bytes, bytearray, Mapping, list, tuple, set, frozenset)
    if isinstance(value, plain):
        return False
    return hasattr(value, "__getitem__") or hasattr(value, "__iter__")


def _nproc(value: Any) -> int | str:
    """``run.nproc_per_node``: a positive integer or ``auto``."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    count = to_int(value, "run.nproc_per_node")
    if count <= 0:
        raise ConfigError("run.nproc_per_node must be a positive integer or auto")
    return at_most(count, "run.nproc_per_node", 1024)


@dataclass
class RunConfig:
    """What to run: name, seed, device, absolute optimizer-step target, output directory."""

    name: str = "speedtronic-run"
    seed: int = 1234
    device: str = "auto"
    max_steps: int = 1000
    output_dir: str = "runs"
    log_every: int | None = None
    stop_on_nonfinite: bool = True
    nproc_per_node: int | str = 1  # ranks on this node; "auto" = visible GPUs (1 on CPU)
    data_parallel: str = "ddp"  # ddp (replicas) | fsdp (sharded parameters, FSDP2)
    collective_timeout: float = 600.0  # seconds a collective waits for the other ranks

    def __post_init__(self) -> None:
        self.name = to_str(self.name, "run.name")
        self.nproc_per_node = _nproc(self.nproc_per_node)
        self.data_parallel = _choice(
            self.data_parallel,
            "run.data_parallel",
            ("ddp", "fsdp"),
            "run.data_parallel must be ddp or fsdp",
        )
        self.collective_timeout = in_range(
            to_float(self.collective_timeout, "run.collective_timeout"),
            "run.collective_timeout",
            0.0,
            86400.0,
            low_open=True,
        )
        self.seed = in_range(to_int(self.seed, "run.seed"), "run.seed", 0, MAX_SEED)
        self.device = to_str(self.device, "run.device").strip()
        self.max_steps = to_int(self.max_steps, "run.max_steps")
        self.output_dir = to_path(self.output_dir, "run.output_dir")
        self.log_every = to_int(self.log_every, "run.log_every", nullable=True)
        self.stop_on_nonfinite = to_bool(self.stop_on_nonfinite, "run.stop_on_nonfinite")
        if not self.device:
            raise ConfigError("run.device must not be empty (use auto, cpu, cuda, cuda:N or mps)")
        if self.max_steps <= 0:
            raise ConfigError("run.max_steps must be positive")
        if self.log_every is not None and self.log_every <= 0:
            raise ConfigError("run.log_every must be positive")
        at_most(self.max_steps, "run.max_steps", MAX_STEPS)
        at_most(self.log_every, "run.log_every", MAX_STEPS)


@dataclass
class ModelConfig:
    """Reference-transformer shape; every field is forwarded to the model factory."""

    name: str = "reference_transformer"
    vocab_size: int = 512
    max_seq_len: int = 128
    n_layer: int = 4
    n_head: int = 8
    n_kv_head: int | None = None
    d_model: int = 256
    d_ff: int | None = None
    dropout: float = 0.0
    tie_weights: bool = True
    rope_base: float = 10000.0
    gradient_checkpointing: bool = False

    def __post_init__(self) -> None:
        self.name = to_str(self.name, "model.name")
        self.vocab_size = to_int(self.vocab_size, "model.vocab_size")
        self.max_seq_len = to_int(self.max_seq_len, "model.max_seq_len")
        self.n_layer = to_int(self.n_layer, "model.n_layer")
        self.n_head = to_int(self.n_head, "model.n_head")
        self.n_kv_head = to_int(self.n_kv_head, "model.n_kv_head", nullable=True)
        self.d_model = to_int(self.d_model, "model.d_model")
        self.d_ff = to_int(self.d_ff, "model.d_ff", nullable=True)
        self.dropout = to_float(self.dropout, "model.dropout")
        self.tie_weights = to_bool(self.tie_weights, "model.tie_weights")
        self.rope_base = to_float(self.rope_base, "model.rope_base")
        self.gradient_checkpointing = to_bool(
            self.gradient_checkpointing, "model.gradient_checkpointing"
        )
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model
        if self.max_seq_len <= 0:
            raise ConfigError("model.max_seq_len must be positive")
        if self.vocab_size <= 0:
            raise ConfigError("model.vocab_size must be positive")
        if min(self.n_layer, self.n_head, self.n_kv_head) <= 0:
            counts = {"model.n_layer": self.n_layer, "model.n_head": self.n_head}
            counts["model.n_kv_head"] = self.n_kv_head
            raise blame("model layer/head counts must be positive", counts, lambda v: v <= 0)
        if self.d_model <= 0 or self.d_ff <= 0:
            dims = {"model.d_model": self.d_model, "model.d_ff": self.d_ff}
            raise blame("model dimensions must be positive", dims, lambda v: v <= 0)
        if self.n_head % self.n_kv_head != 0:
            raise ConfigError("model.n_head must be divisible by model.n_kv_head")
        if self.d_model % self.n_head != 0:
            raise ConfigError("model.d_model must be divisible by model.n_head")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError("model.dropout must be in [0, 1)")
        at_most(self.vocab_size, "model.vocab_size", MAX_VOCAB)
        at_most(self.max_seq_len, "model.max_seq_len", MAX_SEQ_LEN)
        at_most(self.n_layer, "model.n_layer", 1024)
        at_most(self.n_head, "model.n_head", 1024)
        at_most(self.d_model, "model.d_model", 2**17)
        at_most(self.d_ff, "model.d_ff", 2**20)
        in_range(self.rope_base, "model.rope_base", 0.0, 1e12, low_open=True)


@dataclass
class DataConfig:
    """Where batches come from and how big they are.

    Source precedence: ``text_path`` > ``token_path`` > ``dataset`` > synthetic. ``synthetic``
    is ``markov`` (a learnable seeded Markov chain, the default), ``uniform`` (random tokens, for
    throughput work) or ``none``; YAML ``true``/``false`` mean ``markov``/``none``.
    ``num_tokens`` is the number of synthetic *samples* (2.0.0 naming). ``token_path`` is a
    pre-tokenized ``.bin`` (``token_dtype``) or ``.npy`` file; ``allow_pickle`` must be true to
    ``torch.load`` a pickled ``dataset`` file. ``seed`` fixes the Markov chain and the held-out
    data; the training stream (order, windows, synthetic samples) is seeded per node from it.
    ``token_path`` may also be a folder written by ``speedtronic prepare`` (all its shards).
    ``tokenizer`` is ``bytes`` (token = UTF-8 byte) or a ``tokenizer.json`` path / Hub repo id
    (:mod:`speedtronic.config.tokenizer_spec`); its vocabulary is checked against
    ``model.vocab_size`` when the whole config is validated.
    """

    text_path: str | None = None
    dataset: Any = None
    synthetic: str = "markov"
    num_tokens: int = 100000
    vocab_size: int | None = None
    block_size: int | None = None
    micro_batch_size: int = 1
    target_batch_size: int = 1
    num_workers: int = 0
    prefetch_factor: int | None = None
    pin_memory: bool | None = None
    shuffle: bool = False
    drop_last: bool = True
    seed: int | None = None
    max_steps: int | None = None
    token_path: str | None = None
    token_dtype: str = "uint16"
    sampling: str = "random"
    allow_pickle: bool = False
    tokenizer: str = "bytes"

    def __post_init__(self) -> None:
        self.text_path = to_path(self.text_path, "data.text_path", nullable=True)
        if isinstance(self.dataset, str):
            self.dataset = to_path(self.dataset, "data.dataset")
        if (
            self.dataset is not None
            and not isinstance(self.dataset, str)
            and not _dataset_like(self.dataset)
        ):
            raise ConfigError(
                f"data.dataset must be a path string or a Dataset, got {describe(self.dataset)}"
            )
        self.synthetic = _synthetic_kind(self.synthetic)
        self.num_tokens = to_int(self.num_tokens, "data.num_tokens")
        self.vocab_size = to_int(self.vocab_size, "data.vocab_size", nullable=True)
        self.block_size = to_int(self.block_size, "data.block_size", nullable=True)
        self.micro_batch_size = to_int(self.micro_batch_size, "data.micro_batch_size")
        self.target_batch_size = to_int(self.target_batch_size, "data.target_batch_size")
        self.num_workers = to_int(self.num_workers, "data.num_workers")
        self.prefetch_factor = to_int(self.prefetch_factor, "data.prefetch_factor", nullable=True)
        self.pin_memory = to_bool(self.pin_memory, "data.pin_memory", nullable=True)
        self.shuffle = to_bool(self.shuffle, "data.shuffle")
        self.drop_last = to_bool(self.drop_last, "data.drop_last")
        self.seed = in_range(
            to_int(self.seed, "data.seed", nullable=True), "data.seed", 0, MAX_SEED
        )
        self.max_steps = to_int(self.max_steps, "data.max_steps", nullable=True)
        self.token_path = to_path(self.token_path, "data.token_path", nullable=True)
        self.token_dtype = _choice(
            self.token_dtype,
            "data.token_dtype",
            ("uint16", "uint32"),
            "data.token_dtype must be 'uint16' or 'uint32'",
        )
        self.sampling = _choice(
            self.sampling,
            "data.sampling",
            ("random", "sequential"),
            "data.sampling must be 'random' or 'sequential'",
        )
        self.allow_pickle = to_bool(self.allow_pickle, "data.allow_pickle")
        self.tokenizer = to_path(self.tokenizer, "data.tokenizer").strip()
        if self.tokenizer.lower() in ("", "bytes"):
            self.tokenizer = "bytes"
        if self.micro_batch_size <= 0 or self.target_batch_size <= 0:
            sizes = {"data.micro_batch_size": self.micro_batch_size}
            sizes["data.target_batch_size"] = self.target_batch_size
            raise blame("batch sizes must be positive", sizes, lambda v: v <= 0)
        if self.target_batch_size < self.micro_batch_size:
            raise ConfigError("target_batch_size must be >= micro_batch_size")
        if self.target_batch_size % self.micro_batch_size != 0:
            raise ConfigError("target_batch_size must be divisible by micro_batch_size")
        if self.vocab_size is not None and self.vocab_size <= 0:
            raise ConfigError("data.vocab_size must be positive")
        if self.num_tokens <= 0:
            raise ConfigError("data.num_tokens must be positive")
        if self.num_workers < 0:
            raise ConfigError("data.num_workers cannot be negative")
        if self.prefetch_factor is not None and self.prefetch_factor <= 0:
            raise ConfigError("data.prefetch_factor must be positive")
        if self.max_steps is not None and self.max_steps <= 0:
            raise ConfigError("data.max_steps must be positive")
        self._check_upper_bounds()

    def _check_upper_bounds(self) -> None:
        at_most(self.num_tokens, "data.num_tokens", 10**8)  # one epoch's order is materialised
        at_most(self.vocab_size, "data.vocab_size", MAX_VOCAB)
        at_most(self.block_size, "data.block_size", MAX_SEQ_LEN)
        at_most(self.micro_batch_size, "data.micro_batch_size", 2**16)
        at_most(self.target_batch_size, "data.target_batch_size", 2**24)
        at_most(self.num_workers, "data.num_workers", 256)
        at_most(self.prefetch_factor, "data.prefetch_factor", 1024)
        at_most(self.max_steps, "data.max_steps", MAX_STEPS)

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer update (``target_batch_size // micro_batch_size``)."""
        return self.target_batch_size // self.micro_batch_size


MUON_NS_DTYPES = ("auto", "bf16", "fp32")
"""``optimizer.muon_ns_dtype`` choices: Newton–Schulz working precision (``auto``: bf16 where the
device multiplies bf16 natively, see :func:`speedtronic.optim.muon.resolve_ns_dtype`)."""


@dataclass
class OptimizerConfig:
    """Inner optimizer: ``adamw`` (all parameters) or ``muon`` (hidden matrices) + AdamW rest."""

    name: str = "adamw"
    lr: float = 0.0003
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    fused: bool | None = None
    grad_clip: float | None = None
    muon_plus: bool = False
    cautious: bool = False
    muon_momentum: float = 0.95
    muon_ns_steps: int = 5
    muon_norm_eps: float = 1e-8
    muon_ns_dtype: str = "auto"

    def __post_init__(self) -> None:
        self.name = _choice(
            self.name,
            "optimizer.name",
            ("adamw", "muon"),
            "optimizer.name must be 'adamw' or 'muon'",
        )
        self.lr = to_float(self.lr, "optimizer.lr")
        self.betas = self._coerce_betas(self.betas)
        self.eps = to_float(self.eps, "optimizer.eps")
        self.weight_decay = to_float(self.weight_decay, "optimizer.weight_decay")
        self.fused = to_bool(self.fused, "optimizer.fused", nullable=True)
        self.grad_clip = to_float(self.grad_clip, "optimizer.grad_clip", nullable=True)
        flags = "optimizer Muon/cautious flags must be booleans"
        self.muon_plus = to_bool(self.muon_plus, "optimizer.muon_plus", message=flags)
        self.cautious = to_bool(self.cautious, "optimizer.cautious", message=flags)
        self.muon_momentum = to_float(self.muon_momentum, "optimizer.muon_momentum")
        self.muon_ns_steps = to_int(self.muon_ns_steps, "optimizer.muon_ns_steps")
        self.muon_norm_eps = to_float(self.muon_norm_eps, "optimizer.muon_norm_eps")
        self.muon_ns_dtype = _choice(
            self.muon_ns_dtype,
            "optimizer.muon_ns_dtype",
            MUON_NS_DTYPES,
            "optimizer.muon_ns_dtype must be auto, bf16 or fp32",
        )
        if self.lr <= 0:
            raise ConfigError("optimizer.lr must be positive")
        if not all(0.0 <= beta < 1.0 for beta in self.betas):
            raise ConfigError("optimizer.betas must contain two values in [0, 1)")
        if self.eps <= 0 or self.weight_decay < 0:
            bad = {"optimizer.eps": self.eps} if self.eps <= 0 else {}
            if self.weight_decay < 0:
                bad["optimizer.weight_decay"] = self.weight_decay
            message = "optimizer eps must be positive and weight_decay non-negative"
            raise blame(message, bad, lambda v: True)
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ConfigError("optimizer.grad_clip must be positive")
        if self.muon_plus and self.name != "muon":
            raise ConfigError("optimizer.muon_plus is only valid with optimizer.name=muon")
        if not 0.0 <= self.muon_momentum < 1.0:
            raise ConfigError("optimizer.muon_momentum must be in [0, 1)")
        if self.muon_ns_steps <= 0:
            raise ConfigError("optimizer.muon_ns_steps must be positive")
        if self.muon_norm_eps <= 0:
            raise ConfigError("optimizer.muon_norm_eps must be positive")
        at_most(self.weight_decay, "optimizer.weight_decay", 1000.0)
        at_most(self.grad_clip, "optimizer.grad_clip", 1e9)
        at_most(self.eps, "optimizer.eps", 1.0)
        at_most(self.muon_norm_eps, "optimizer.muon_norm_eps", 1.0)
        at_most(self.muon_ns_steps, "optimizer.muon_ns_steps", 100)

    @staticmethod
    def _coerce_betas(value: Any) -> tuple[float, float]:
        message = "optimizer.betas must contain two values in [0, 1)"
        if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
            raise ConfigError(f"{message}, got {describe(value)}")
        if len(value) != 2:
            raise ConfigError(message)
        first, second = (to_float(beta, "optimizer.betas item") for beta in value)
        return (first, second)


@dataclass
class SchedulerConfig:
    """Learning-rate schedule: linear warmup then cosine (or constant) up to ``max_steps``.

    ``max_steps: null`` (the default) means "follow the effective run target"
    (``data.max_steps`` or ``run.max_steps``); the aggregate fills in the number and remembers
    that it was not explicit, so later target changes keep following (see
    ``SpeedtronicConfig.apply_run_target``). An explicit value is kept.
    """

    name: str = "cosine"
    warmup_steps: int = 100
    max_steps: int | None = None
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        self.name = _choice(
            self.name,
            "scheduler.name",
            ("cosine", "constant"),
            "scheduler.name must be 'cosine' or 'constant'",
        )
        self.warmup_steps = to_int(self.warmup_steps, "scheduler.warmup_steps")
        self.max_steps = to_int(self.max_steps, "scheduler.max_steps", nullable=True)
        self.min_lr_ratio = to_float(self.min_lr_ratio, "scheduler.min_lr_ratio")
        if self.warmup_steps < 0 or (self.max_steps is not None and self.max_steps <= 0):
            bad = {"scheduler.warmup_steps": self.warmup_steps} if self.warmup_steps < 0 else {}
            if self.max_steps is not None and self.max_steps <= 0:
                bad["scheduler.max_steps"] = self.max_steps
            message = "scheduler steps must be non-negative/max_steps positive"
            raise blame(message, bad, lambda v: True)
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError("scheduler.min_lr_ratio must be in [0, 1]")
        at_most(self.warmup_steps, "scheduler.warmup_steps", MAX_STEPS)
        at_most(self.max_steps, "scheduler.max_steps", MAX_STEPS)
        # Not a dataclass field: excluded from eq/repr/to_dict; set by the aggregate too.
        self.max_steps_explicit = self.max_steps is not None


@dataclass
class PrecisionConfig:
    """Autocast precision request; hardware fallbacks happen at runtime."""

    mode: str = "auto"
    dtype: str | None = None

    def __post_init__(self) -> None:
        self.mode = _choice(
            self.mode,
            "precision.mode",
            ("auto", "bf16", "fp16", "fp32"),
            "precision.mode must be auto, bf16, fp16, or fp32",
        )
        if self.dtype is not None:
            self.dtype = _choice(
                self.dtype,
                "precision.dtype",
                ("bf16", "fp16", "fp32"),
                "precision.dtype must be bf16, fp16, or fp32",
            )


@dataclass
class EvalConfig:
    """Held-out evaluation: where the held-out tokens come from, how often, how many.

    The held-out source is ``text_path`` (a UTF-8 file, byte-level tokens), ``token_path`` (a
    ``.bin``/``.npy`` token file read with ``data.token_dtype``), or ``holdout``: the last
    fraction of the training source, which training then never reads (for synthetic data a
    disjoint held-out sample domain of ``holdout * data.num_tokens`` samples). Eval is active
    when one of them is set. ``every_steps``: an eval every N optimizer steps (``0`` = only the
    one at the end of ``fit()``). ``tokens``: target tokens scored per eval, taken as
    sequential windows of ``block_size + 1`` from the start of the held-out region (rounded up
    to whole windows). ``batch_size`` defaults to ``data.micro_batch_size``.
    """

    text_path: str | None = None
    token_path: str | None = None
    holdout: float = 0.0
    every_steps: int = 200
    tokens: int = 8192
    batch_size: int | None = None

    def __post_init__(self) -> None:
        self.text_path = to_path(self.text_path, "eval.text_path", nullable=True)
        self.token_path = to_path(self.token_path, "eval.token_path", nullable=True)
        self.holdout = to_float(self.holdout, "eval.holdout")
        self.every_steps = to_int(self.every_steps, "eval.every_steps")
        self.tokens = to_int(self.tokens, "eval.tokens")
        self.batch_size = to_int(self.batch_size, "eval.batch_size", nullable=True)
        if not 0.0 <= self.holdout < 1.0:
            raise ConfigError(
                f"eval.holdout must be in [0, 1) (a fraction of the training data), "
                f"got {self.holdout}"
            )
        if self.every_steps < 0:
            raise ConfigError("eval.every_steps must be >= 0 (0 = evaluate only at the end)")
        if self.tokens <= 0:
            raise ConfigError("eval.tokens must be positive")
        if self.batch_size is not None and self.batch_size <= 0:
            raise ConfigError("eval.batch_size must be positive")
        at_most(self.every_steps, "eval.every_steps", MAX_STEPS)
        at_most(self.tokens, "eval.tokens", 2**31 - 1)
        at_most(self.batch_size, "eval.batch_size", 2**16)
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
