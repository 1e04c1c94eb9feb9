"""What a trainer saves and restores, as registered checkpoint parts.

The trainer registers its state once, in ``__init__``, as a
:class:`~speedtronic.checkpoint.CheckpointParts` held by its :class:`TrainerCheckpoint`::

    train        TrainProgress  step, samples, tokens, skipped_updates (at the file's root)
    model        the nn.Module
    optimizer    the optimizer
    scheduler    the LR scheduler, or None
    scaler       the GradScaler (CUDA fp16), or None
    data         DataPosition   micro-batches consumed + the loader's own position
    evals        EvalHistory    the run's held-out evaluations so far (the model card's)
    rng          RNGState       Python, NumPy, torch, CUDA generators (loaded last)
    coordinator  the DiLoCo coordinator, or None (it applies its state at ``start``)

``TrainerCheckpoint.state_dict()`` adds provenance (format, precision, redacted config,
versions) and returns tensors and primitive containers only, so checkpoints load with
``torch.load(weights_only=True)``. ``TrainerCheckpoint.resume(state)`` first checks that the
state fits this trainer (:func:`check_resumable`: parameter names and shapes, valid counters,
the same optimizer groups and state shapes) and
raises :class:`~speedtronic.checkpoint.CheckpointError` before changing anything when it does
not, so ``CheckpointManager.load_latest(use=trainer.resume)`` falls back to an older checkpoint;
then every part is loaded in place. The data part rebuilds the batch stream at the saved
position before the RNG part restores the generators, so creating the iterator cannot perturb
them.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import torch

from speedtronic.checkpoint import CheckpointError, CheckpointManager, CheckpointParts, check_finite
from speedtronic.config import SpeedtronicConfig
from speedtronic.data.loader import data_state_dict, load_data_state_dict
from speedtronic.json_types import JSON, JSONView, StateDict
from speedtronic.metrics.logger import MetricLogger
from speedtronic.train.forward import Batch, BatchStream
from speedtronic.train.precision import PrecisionPlan

__all__ = [
    "Counters",
    "DataPosition",
    "EvalHistory",
    "TrainProgress",
    "TrainerCheckpoint",
    "check_resumable",
    "portable_config",
]

CHECKPOINT_FORMAT = "speedtronic-checkpoint/1"


class DataPosition:
    """The trainer's place in its data: the loader, the live batch stream, batches consumed.

    A resumable loader (``speedtronic.data.ResumableDataLoader``) restores its own position;
    any other re-iterable is fast-forwarded by the saved micro-batch count.
    """

    def __init__(self, loader: Iterable[Batch]) -> None:
        self.loader = loader
        self.consumed = 0  # micro-batches handed to the trainer
        self._stream: BatchStream | None = None

    def next_batch(self) -> Batch:
        """The next micro-batch (the stream starts on first use)."""
        if self._stream is None:
            self._stream = BatchStream(self.loader)
        batch = next(self._stream)
        self.consumed += 1
        return batch

    def state_dict(self) -> StateDict:
        """``{"batches": consumed, "loader": <the loader's state_dict() or None>}``."""
        return {"batches": self.consumed, "loader": data_state_dict(self.loader)}

    def load_state_dict(self, state: JSONView) -> None:
        """Restart the stream at the saved position now."""
        restored = load_data_state_dict(self.loader, state.get("loader"))  # a user's may not
        self._stream = BatchStream(self.loader)
        self.consumed = int(state.get("batches", 0))
        if not restored:
            for _ in range(self.consumed):
                next(self._stream)


class EvalHistory:
    """The run's held-out evaluations as a checkpoint part: a logger hook that keeps every
    ``eval`` event (``step``, ``loss``, ``scope``, ``outer_step``), so a checkpoint carries the
    evaluations up to its step and ``speedtronic push`` writes them on the model card without
    the run's JSONL log. Kept across a resume; at most :attr:`LIMIT` (the newest)."""

    LIMIT = 10_000

    def __init__(self) -> None:
        self.records: list[JSON] = []

    def on_event(self, event: str, payload: JSONView) -> None:
        """Logger hook: keep an ``eval`` event that has a numeric loss."""
        loss = payload.get("loss")
        if event != "eval" or isinstance(loss, bool) or not isinstance(loss, (int, float)):
            return
        keys = ("step", "loss", "scope", "outer_step")
        self.records.append({k: payload[k] for k in keys if payload.get(k) is not None})
        del self.records[: -self.LIMIT]

    def state_dict(self) -> dict[str, list[JSON]]:
        """``{"records": [...]}`` (numbers and strings only)."""
        return {"records": [dict(record) for record in self.records]}

    def load_state_dict(self, state: JSONView) -> None:
        """The records a checkpoint saved (anything else in it is dropped)."""
        self.records = eval_records(state.get("records"))


def eval_records(value: object) -> list[JSON]:
    """The well-formed ``eval`` records of a checkpoint's ``evals`` part: dicts with a numeric
    ``loss``, the newest :attr:`EvalHistory.LIMIT` of them (a file is data, not trusted)."""
    if not isinstance(value, list):
        return []
    kept = [
        {k: v for k, v in record.items() if k in ("step", "loss", "scope", "outer_step")}
        for record in value
        if isinstance(record, dict)
        and isinstance(record.get("loss"), (int, float))
        and not isinstance(record.get("loss"), bool)
    ]
    return kept[-EvalHistory.LIMIT :]


class Counters(Protocol):
    """What :class:`TrainProgress` saves: the trainer's counters."""

    step: int
    samples: int
    tokens: int
    skipped_updates: int


class TrainProgress:
    """The trainer's counters as a checkpoint part (the attributes stay on the trainer)."""

    KEYS = ("step", "samples", "tokens", "skipped_updates")

    def __init__(self, counters: Counters) -> None:
        self.counters = counters

    def state_dict(self) -> dict[str, int]:
        """``{"step": .., "samples": .., "tokens": .., "skipped_updates": ..}``."""
        c = self.counters
        return {
            "step": int(c.step),
            "samples": int(c.samples),
            "tokens": int(c.tokens),
            "skipped_updates": int(c.skipped_updates),
        }

    def load_state_dict(self, state: JSONView) -> None:
        """Set the counters that ``state`` records (others keep their value)."""
        c = self.counters
        c.step = int(state.get("step", c.step))
        c.samples = int(state.get("samples", c.samples))
        c.tokens = int(state.get("tokens", c.tokens))
        c.skipped_updates = int(state.get("skipped_updates", c.skipped_updates))


_PATH_FIELDS = (
    ("model", "init_from"),
    ("data", "text_path"),
    ("data", "token_path"),
    ("data", "tokenizer"),
    ("eval", "text_path"),
    ("eval", "token_path"),
)


def portable_config(config: SpeedtronicConfig) -> JSON:
    """The redacted config a checkpoint (and ``final/``) carries, with the data and tokenizer
    paths that exist made absolute, so ``eval``/``sample``/``export --checkpoint`` find them
    from any working directory (the tokenizer itself also travels inside the checkpoint)."""
    values = config.to_dict(redact_secrets=True)
    for section, field in _PATH_FIELDS:
        part = values.get(section)
        if not isinstance(part, dict):
            continue
        value = part.get(field)
        if isinstance(value, str) and value.strip() and value.strip().lower() != "bytes":
            path = Path(value).expanduser()
            if not path.is_absolute() and path.exists():
                part[field] = str(path.resolve())
    return values


def check_resumable(
    state: JSONView, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    """Raise ``CheckpointError`` (naming the mismatch) when ``state`` cannot resume ``model``
    and ``optimizer``: other parameter names or shapes, NaN or inf weights, an invalid step or
    counter, other optimizer groups or optimizer state of other shapes. Changes nothing."""
    source = state.get("path", "checkpoint")
    saved = state.get("model")
    if not isinstance(saved, dict):
        raise CheckpointError(f"{source} holds no model state")
    mine = model.state_dict()
    missing, extra = sorted(set(mine) - set(saved)), sorted(set(saved) - set(mine))
    if missing or extra:
        raise CheckpointError(
            f"{source} is for another model: missing {missing[:3]}, unexpected {extra[:3]}"
        )
    for name, tensor in mine.items():
        theirs = saved[name]
        if not isinstance(theirs, torch.Tensor) or theirs.shape != tensor.shape:
            shape = tuple(theirs.shape) if isinstance(theirs, torch.Tensor) else type(theirs)
            raise CheckpointError(
                f"{source} is for another model: {name} is {shape}, "
                f"this model has {tuple(tensor.shape)}"
            )
    check_finite(saved, str(source))  # NaN weights would train on as loss=nan
    for key in TrainProgress.KEYS:
        value = state.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CheckpointError(f"{source} records an invalid {key}: {value!r:.40}")
    if state.get("optimizer") is not None:
        _check_optimizer_state(state["optimizer"], optimizer, source)


def _check_optimizer_state(saved: object, optimizer: torch.optim.Optimizer, source: str) -> None:
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if (
        not isinstance(saved, dict)
        or not isinstance(groups, list)
        or not all(isinstance(g, dict) for g in groups)
    ):
        raise CheckpointError(f"{source} holds no optimizer parameter groups")
    current = optimizer.param_groups
    theirs = [(len(g.get("params", [])), g.get("algorithm")) for g in groups]
    ours = [(len(g["params"]), g.get("algorithm")) for g in current]
    if theirs != ours:
        raise CheckpointError(
            f"{source} has other optimizer groups (parameters, algorithm): {theirs}, "
            f"this run has {ours}"
        )
    params = [p for group in current for p in group["params"]]
    ids = [i for group in groups for i in group.get("params", [])]
    by_id = dict(zip(ids, params, strict=True))
    for key, entry in (saved.get("state") or {}).items():
        param = by_id.get(key)
        if param is None or not isinstance(entry, dict):
            raise CheckpointError(f"{source} has optimizer state for unknown parameter {key}")
        for name, value in entry.items():
            tensor = isinstance(value, torch.Tensor) and value.numel() > 1
            if tensor and value.shape != param.shape:
                raise CheckpointError(
                    f"{source} has optimizer state {name} of shape "
                    f"{tuple(value.shape)} for a parameter of shape {tuple(param.shape)}"
                )


class TrainerCheckpoint:
    """The trainer's checkpoints: its registered ``parts``, when they are written, and resume.

    ``parts`` is the trainer's :class:`CheckpointParts` (the ``train`` part is its
    :class:`TrainProgress`); ``manager`` writes the files (``None``: no checkpoints). ``model``
    and ``optimizer`` are what :func:`check_resumable` compares a state with; ``config``,
    ``precision`` and the tokenizer travel as provenance. On a data-parallel node every rank
    builds the state (FSDP gathers it) and only the main rank (``is_main``) writes it.
    """

    def __init__(
        self,
        parts: CheckpointParts,
        manager: CheckpointManager | None,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        config: SpeedtronicConfig,
        precision: PrecisionPlan,
        logger: MetricLogger,
        is_main: bool = True,
    ) -> None:
        self.parts = parts
        self.manager = manager
        self.model = model
        self.optimizer = optimizer
        self.config = config
        self.precision = precision
        self.logger = logger
        self.is_main = is_main
        self.last_saved_step = -1
        self.resave = False  # the weights changed after this step's checkpoint was written
        self._tokenizer: tuple[JSON | None] | None = None  # read at the first save

    def start(self) -> None:
        """Training starts: the manager deletes what ``claim(overwrite=True)`` left to it."""
        if self.manager is not None:
            self.manager.start()

    def maybe_save(self, step: int) -> None:
        """Save when ``step`` is on the manager's interval and not saved yet."""
        manager = self.manager
        due = manager is not None and manager.should_save(step)
        if due and step != self.last_saved_step:
            self.save(step)

    def weights_replaced(self, step: int) -> None:
        """The coordinator installed the final global after the loop: a checkpoint already
        written at this step holds the weights from before it and is written again (with
        ``save_final: false`` too), so the newest checkpoint is the final model."""
        if self.last_saved_step == step:
            self.last_saved_step = -1
            self.resave = True

    def save_final(self, step: int, *, stopped: bool) -> None:
        """The end of ``fit``: save unless disabled, at step 0, already saved at ``step``, or
        ``save_final: false`` on a run that neither stopped early nor got new weights."""
        manager = self.manager
        if manager is None or not manager.enabled or step <= 0:
            return
        if not manager.save_final and not stopped and not self.resave:
            return
        if step != self.last_saved_step:
            self.save(step)
        self.resave = False

    def save(self, step: int) -> Path | None:
        """Save the full training state as ``step``; emits ``checkpoint_saved``.

        On a data-parallel node only rank 0 writes (the others return ``None``)."""
        if self.manager is None:
            raise CheckpointError("this trainer has no checkpoint manager to save with")
        began = time.perf_counter()
        state = self.state_dict()  # FSDP: every rank joins the gather of the full state
        self.last_saved_step = step
        if not self.is_main:
            return None  # rank 0 writes the node's checkpoint
        path = self.manager.save(step, state)
        self.logger.emit(
            "checkpoint_saved",
            {"step": step, "path": str(path), "seconds": time.perf_counter() - began},
        )
        return path

    def state_dict(self) -> StateDict:
        """Everything needed for an exact resume (tensors and primitive containers only)."""
        import speedtronic

        precision = self.precision
        return {
            "format": CHECKPOINT_FORMAT,
            **self.parts.state_dict(),
            "precision": {
                "mode": precision.mode,
                "autocast_enabled": precision.autocast_enabled,
                "use_scaler": precision.use_scaler,
            },
            "config": portable_config(self.config),
            "tokenizer": self._tokenizer_record(),
            "versions": {"speedtronic": speedtronic.__version__, "torch": str(torch.__version__)},
        }

    def _tokenizer_record(self) -> JSON | None:
        """The tokenizer that travels in every checkpoint (read once; ``None`` for bytes, or
        with a warning when the file cannot be read: the checkpoint is written anyway)."""
        if self._tokenizer is None:
            from speedtronic.data.tokenizer import tokenizer_record

            record = None
            try:
                record = tokenizer_record(
                    self.config.data.tokenizer, token=self.config.distributed.token
                )
            except (OSError, ValueError) as exc:
                self.logger.warning("the tokenizer does not travel with the checkpoints: %s", exc)
            self._tokenizer = (record,)
        return self._tokenizer[0]

    def resume(self, state: StateDict, *, counters: Counters) -> None:
        """Check ``state`` (:func:`check_resumable`), then load it into every part in place;
        the step ``counters`` hold afterwards counts as saved."""
        check_resumable(state, self.model, self.optimizer)
        self.parts.load_state_dict(state)
        self.last_saved_step = counters.step
