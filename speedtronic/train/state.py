"""What a trainer saves and restores: checkpoint state, data position, RNG, scaler.

``TrainerStateMixin`` holds the persistence half of :class:`speedtronic.train.trainer.Trainer`
(it relies on the trainer's attributes: model, optimizer, scheduler, scaler, counters,
coordinator, checkpoint manager, logger). ``state_dict()`` returns tensors and primitive
containers only, so checkpoints load with ``torch.load(weights_only=True)``; ``resume(state)``
restores everything for an exact continuation: weights and optimizer/scheduler/scaler state at
once, the data position and RNG at the next ``fit()`` (loader first, then RNG, so iterator
creation cannot perturb the restored generators). ``resume`` first checks that the state fits
this trainer (:meth:`TrainerStateMixin.check_resumable`: parameter names and shapes, a valid
step and counters, the same optimizer groups and state shapes) and raises
:class:`~speedtronic.checkpoint.CheckpointError` before changing anything when it does not, so
``CheckpointManager.load_latest(use=trainer.resume)`` falls back to an older checkpoint.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch

from speedtronic.checkpoint import CheckpointError, capture_rng_state, restore_rng_state
from speedtronic.train.forward import BatchStream
from speedtronic.train.precision import make_grad_scaler

__all__ = ["TrainerStateMixin"]


class TrainerStateMixin:
    """Checkpoint save/restore and the resumable batch stream of the ``Trainer``."""

    model: Any
    optimizer: Any
    scheduler: Any
    scaler: Any
    precision: Any
    config: Any
    coordinator: Any
    checkpoint_manager: Any
    logger: Any
    dataloader: Any
    step: int
    samples: int
    tokens: int
    skipped_updates: int
    _stop_reason: str | None
    _batch_iter: BatchStream | None
    _batches_consumed: int
    _resume_data: dict[str, Any] | None
    _pending_rng: dict[str, Any] | None
    _deferred_scaler_state: dict[str, Any] | None
    _deferred_coordinator_state: dict[str, Any] | None
    _last_saved_step: int

    # ------------------------------------------------------------------ data position

    def _batches(self) -> Iterator[Any]:
        """The persistent batch stream; after a resume, positioned where the checkpoint was.

        A resumable loader (``speedtronic.data.ResumableDataLoader``) restores its own position;
        any other re-iterable is fast-forwarded by the saved micro-batch count. Both happen
        before the checkpointed RNG state is restored, so iterator creation does not perturb it.
        """
        if self._batch_iter is None:
            resume, self._resume_data = self._resume_data, None
            restored = False
            if resume and resume.get("loader") is not None:
                load = getattr(self.dataloader, "load_state_dict", None)
                if callable(load):
                    load(resume["loader"])
                    restored = True
            self._batch_iter = BatchStream(self.dataloader)
            if resume:
                self._batches_consumed = int(resume.get("batches", 0))
                if not restored:
                    for _ in range(self._batches_consumed):
                        next(self._batch_iter)
        if self._pending_rng is not None:
            restore_rng_state(self._pending_rng)
            self._pending_rng = None
        return self._batch_iter

    # ------------------------------------------------------------------ checkpoints

    def _make_scaler(self) -> None:
        self.scaler = make_grad_scaler(self.precision)
        if self.scaler is not None and self._deferred_scaler_state is not None:
            self.scaler.load_state_dict(self._deferred_scaler_state)
            self._deferred_scaler_state = None

    def _maybe_checkpoint(self) -> None:
        manager = self.checkpoint_manager
        due = manager is not None and manager.should_save(self.step)
        if due and self.step != self._last_saved_step:
            self.save_checkpoint()

    def _save_final(self) -> None:
        manager = self.checkpoint_manager
        if manager is None or not manager.enabled or self.step <= 0:
            return
        if not getattr(manager, "save_final", True) and self._stop_reason is None:
            return
        if self.step != self._last_saved_step:
            self.save_checkpoint()

    def save_checkpoint(self) -> Any:
        """Save the full training state for the current step; emits ``checkpoint_saved``."""
        began = time.perf_counter()
        path = self.checkpoint_manager.save(self.step, self.state_dict())
        self._last_saved_step = self.step
        self.logger.emit(
            "checkpoint_saved",
            {"step": self.step, "path": str(path), "seconds": time.perf_counter() - began},
        )
        return path

    def state_dict(self) -> dict[str, Any]:
        """Everything needed for an exact resume (tensors and primitive containers only)."""
        import speedtronic

        config = None
        if self.config is not None and hasattr(self.config, "to_dict"):
            config = self.config.to_dict(redact_secrets=True)
        coordinator_state = self.coordinator.state_dict() if self.coordinator is not None else None
        return {
            "format": "speedtronic-checkpoint/1",
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "step": self.step,
            "samples": self.samples,
            "tokens": self.tokens,
            "skipped_updates": self.skipped_updates,
            "data": {"batches": self._batches_consumed, "loader": self._loader_state()},
            "rng": capture_rng_state(),
            "coordinator": coordinator_state,
            "precision": {
                "mode": self.precision.mode,
                "autocast_enabled": self.precision.autocast_enabled,
                "use_scaler": self.precision.use_scaler,
            },
            "config": config,
            "versions": {"speedtronic": speedtronic.__version__, "torch": str(torch.__version__)},
        }

    def _loader_state(self) -> dict[str, Any] | None:
        get = getattr(self.dataloader, "state_dict", None)
        return dict(get()) if callable(get) else None

    def check_resumable(self, state: dict[str, Any]) -> None:
        """Raise ``CheckpointError`` (naming the mismatch) when ``state`` cannot resume this
        trainer: other parameter names or shapes, an invalid step or counter, other optimizer
        groups or optimizer state of other shapes. Changes nothing."""
        source = state.get("path", "checkpoint")
        model = state.get("model")
        if not isinstance(model, dict):
            raise CheckpointError(f"{source} holds no model state")
        mine = self.model.state_dict()
        missing, extra = sorted(set(mine) - set(model)), sorted(set(model) - set(mine))
        if missing or extra:
            raise CheckpointError(
                f"{source} is for another model: missing {missing[:3]}, unexpected {extra[:3]}"
            )
        for name, tensor in mine.items():
            theirs = model[name]
            if not isinstance(theirs, torch.Tensor) or theirs.shape != tensor.shape:
                shape = tuple(theirs.shape) if isinstance(theirs, torch.Tensor) else type(theirs)
                raise CheckpointError(
                    f"{source} is for another model: {name} is {shape}, "
                    f"this model has {tuple(tensor.shape)}"
                )
        for key in ("step", "samples", "tokens", "skipped_updates"):
            value = state.get(key, 0)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise CheckpointError(f"{source} records an invalid {key}: {value!r:.40}")
        if state.get("optimizer") is not None:
            self._check_optimizer_state(state["optimizer"], source)

    def _check_optimizer_state(self, saved: Any, source: str) -> None:
        groups = saved.get("param_groups") if isinstance(saved, dict) else None
        if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
            raise CheckpointError(f"{source} holds no optimizer parameter groups")
        current = self.optimizer.param_groups
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

    def resume(self, state: dict[str, Any]) -> None:
        """Load a checkpoint state; data position and RNG take effect at the next ``fit()``.

        ``CheckpointError`` (nothing changed) when :meth:`check_resumable` rejects it."""
        self.check_resumable(state)
        self.model.load_state_dict(state["model"])
        if state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self._deferred_scaler_state = state.get("scaler")
        self.step = int(state.get("step", self.step))
        self.samples = int(state.get("samples", self.samples))
        self.tokens = int(state.get("tokens", self.tokens))
        self.skipped_updates = int(state.get("skipped_updates", 0))
        self._last_saved_step = self.step
        self._resume_data = dict(state.get("data") or {})
        self._batch_iter = None
        self._pending_rng = state.get("rng")
        coordinator_state = state.get("coordinator")
        if self.coordinator is not None and coordinator_state is not None:
            prepare = getattr(self.coordinator, "prepare_state", None)
            if callable(prepare):
                prepare(coordinator_state)
                self._deferred_coordinator_state = None
            else:
                self._deferred_coordinator_state = coordinator_state
