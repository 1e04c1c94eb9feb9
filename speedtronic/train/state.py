"""What a trainer saves and restores, as registered checkpoint parts.

The trainer registers its state once, in ``__init__``, as a
:class:`~speedtronic.checkpoint.CheckpointParts` (:meth:`TrainerStateMixin._register_parts`)::

    train        TrainProgress  step, samples, tokens, skipped_updates (at the file's root)
    model        the nn.Module
    optimizer    the optimizer
    scheduler    the LR scheduler, or None
    scaler       the GradScaler (CUDA fp16), or None
    data         DataPosition   micro-batches consumed + the loader's own position
    rng          RNGState       Python, NumPy, torch, CUDA generators (loaded last)
    coordinator  the DiLoCo coordinator, or None (it applies its state at ``start``)

``state_dict()`` adds provenance (format, precision, redacted config, versions) and returns
tensors and primitive containers only, so checkpoints load with ``torch.load(weights_only=True)``.
``resume(state)`` first checks that the state fits this trainer (:func:`check_resumable`:
parameter names and shapes, valid counters, the same optimizer groups and state shapes) and
raises :class:`~speedtronic.checkpoint.CheckpointError` before changing anything when it does
not, so ``CheckpointManager.load_latest(use=trainer.resume)`` falls back to an older checkpoint;
then every part is loaded in place. The data part rebuilds the batch stream at the saved
position before the RNG part restores the generators, so creating the iterator cannot perturb
them.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from speedtronic.checkpoint import CheckpointError, CheckpointParts, RNGState
from speedtronic.config import SpeedtronicConfig
from speedtronic.train.forward import BatchStream

__all__ = [
    "DataPosition",
    "TrainProgress",
    "TrainerStateMixin",
    "check_resumable",
    "portable_config",
]

CHECKPOINT_FORMAT = "speedtronic-checkpoint/1"


class DataPosition:
    """The trainer's place in its data: the loader, the live batch stream, batches consumed.

    A resumable loader (``speedtronic.data.ResumableDataLoader``) restores its own position;
    any other re-iterable is fast-forwarded by the saved micro-batch count.
    """

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.consumed = 0  # micro-batches handed to the trainer
        self._stream: BatchStream | None = None

    def next_batch(self) -> Any:
        """The next micro-batch (the stream starts on first use)."""
        if self._stream is None:
            self._stream = BatchStream(self.loader)
        batch = next(self._stream)
        self.consumed += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        """``{"batches": consumed, "loader": <the loader's state_dict() or None>}``."""
        get = getattr(self.loader, "state_dict", None)
        return {"batches": self.consumed, "loader": dict(get()) if callable(get) else None}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restart the stream at the saved position now."""
        load = getattr(self.loader, "load_state_dict", None)
        restored = state.get("loader") is not None and callable(load)
        if restored:
            load(state["loader"])
        self._stream = BatchStream(self.loader)
        self.consumed = int(state.get("batches", 0))
        if not restored:
            for _ in range(self.consumed):
                next(self._stream)


class TrainProgress:
    """The trainer's counters as a checkpoint part (the attributes stay on the trainer)."""

    KEYS = ("step", "samples", "tokens", "skipped_updates")

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, int]:
        """``{"step": .., "samples": .., "tokens": .., "skipped_updates": ..}``."""
        return {key: int(getattr(self.trainer, key)) for key in self.KEYS}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Set the counters that ``state`` records (others keep their value)."""
        for key in self.KEYS:
            if key in state:
                setattr(self.trainer, key, int(state[key]))


_PATH_FIELDS = (
    ("model", "init_from"),
    ("data", "text_path"),
    ("data", "token_path"),
    ("data", "tokenizer"),
    ("eval", "text_path"),
    ("eval", "token_path"),
)


def portable_config(config: SpeedtronicConfig) -> dict[str, Any]:
    """The redacted config a checkpoint (and ``final/``) carries, with the data and tokenizer
    paths that exist made absolute, so ``eval``/``sample``/``export --checkpoint`` find them
    from any working directory (the tokenizer itself also travels inside the checkpoint)."""
    values = config.to_dict(redact_secrets=True)
    for section, field in _PATH_FIELDS:
        part = values.get(section)
        value = part.get(field) if isinstance(part, dict) else None
        if isinstance(value, str) and value.strip() and value.strip().lower() != "bytes":
            path = Path(value).expanduser()
            if not path.is_absolute() and path.exists():
                part[field] = str(path.resolve())
    return values


def check_resumable(state: Mapping[str, Any], model: torch.nn.Module, optimizer: Any) -> None:
    """Raise ``CheckpointError`` (naming the mismatch) when ``state`` cannot resume ``model``
    and ``optimizer``: other parameter names or shapes, an invalid step or counter, other
    optimizer groups or optimizer state of other shapes. Changes nothing."""
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
    for key in TrainProgress.KEYS:
        value = state.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CheckpointError(f"{source} records an invalid {key}: {value!r:.40}")
    if state.get("optimizer") is not None:
        _check_optimizer_state(state["optimizer"], optimizer, source)


def _check_optimizer_state(saved: Any, optimizer: Any, source: str) -> None:
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
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


class TrainerStateMixin:
    """Checkpoint save/restore of the ``Trainer`` through its registered parts."""

    model: Any
    optimizer: Any
    scheduler: Any
    scaler: Any
    precision: Any
    config: SpeedtronicConfig
    coordinator: Any
    checkpoint_manager: Any
    logger: Any
    data: DataPosition
    parallel: Any
    step: int
    _stop_reason: str | None
    _last_saved_step: int
    _resave: bool
    _tokenizer_travel: tuple[dict[str, Any] | None] | None

    def _register_parts(self) -> CheckpointParts:
        """The checkpoint parts of this trainer, in load order (see the module docstring);
        under FSDP the model and optimizer parts hold the full, unsharded state."""
        model, optimizer = self.parallel.checkpoint_parts(self.model, self.optimizer)
        return CheckpointParts(
            {
                "train": TrainProgress(self),
                "model": model,
                "optimizer": optimizer,
                "scheduler": self.scheduler,
                "scaler": self.scaler,
                "data": self.data,
                "rng": RNGState(),
                "coordinator": self.coordinator,
            },
            root="train",
        )

    def _maybe_checkpoint(self) -> None:
        manager = self.checkpoint_manager
        due = manager is not None and manager.should_save(self.step)
        if due and self.step != self._last_saved_step:
            self.save_checkpoint()

    def _weights_replaced(self) -> None:
        """The coordinator installed the final global after the loop: a checkpoint already
        written at this step holds the weights from before it and is written again (with
        ``save_final: false`` too), so the newest checkpoint is the final model."""
        if self._last_saved_step == self.step:
            self._last_saved_step = -1
            self._resave = True

    def _save_final(self) -> None:
        manager = self.checkpoint_manager
        if manager is None or not manager.enabled or self.step <= 0:
            return
        if not manager.save_final and self._stop_reason is None and not self._resave:
            return
        if self.step != self._last_saved_step:
            self.save_checkpoint()
        self._resave = False

    def save_checkpoint(self) -> Any:
        """Save the full training state for the current step; emits ``checkpoint_saved``.

        On a data-parallel node only rank 0 writes (the others return ``None``)."""
        began = time.perf_counter()
        state = self.state_dict()  # FSDP: every rank joins the gather of the full state
        self._last_saved_step = self.step
        if not self.parallel.is_main:
            return None  # rank 0 writes the node's checkpoint
        path = self.checkpoint_manager.save(self.step, state)
        self.logger.emit(
            "checkpoint_saved",
            {"step": self.step, "path": str(path), "seconds": time.perf_counter() - began},
        )
        return path

    def state_dict(self) -> dict[str, Any]:
        """Everything needed for an exact resume (tensors and primitive containers only)."""
        import speedtronic

        return {
            "format": CHECKPOINT_FORMAT,
            **self.parts.state_dict(),
            "precision": {
                "mode": self.precision.mode,
                "autocast_enabled": self.precision.autocast_enabled,
                "use_scaler": self.precision.use_scaler,
            },
            "config": portable_config(self.config),
            "tokenizer": self._tokenizer_record(),
            "versions": {"speedtronic": speedtronic.__version__, "torch": str(torch.__version__)},
        }

    def _tokenizer_record(self) -> dict[str, Any] | None:
        """The tokenizer that travels in every checkpoint (read once; ``None`` for bytes, or
        with a warning when the file cannot be read: the checkpoint is written anyway)."""
        if self._tokenizer_travel is None:
            from speedtronic.config.tokenizer_file import tokenizer_record

            record = None
            try:
                record = tokenizer_record(
                    self.config.data.tokenizer, token=self.config.distributed.token
                )
            except (OSError, ValueError) as exc:
                self.logger.warning("the tokenizer does not travel with the checkpoints: %s", exc)
            self._tokenizer_travel = (record,)
        return self._tokenizer_travel[0]

    def check_resumable(self, state: dict[str, Any]) -> None:
        """:func:`check_resumable` for this trainer's model and optimizer."""
        check_resumable(state, self.model, self.optimizer)

    def resume(self, state: dict[str, Any]) -> None:
        """Load a checkpoint state into every registered part, in place.

        ``CheckpointError`` (nothing changed) when :func:`check_resumable` rejects it."""
        self.check_resumable(state)
        self.parts.load_state_dict(state)
        self._last_saved_step = self.step
