"""The training loop: ``Trainer.fit`` runs optimizer updates up to an absolute step target.

One update (``_train_step``) = K micro-batches (``data.accumulation_steps``): forward under
autocast, ``loss / K`` backward, then one host sync that reads the loss sum, the gradient norm
and the token count together, then ``_optimizer_step``. ``_agree`` makes it the node's update
when the node trains on several ranks (:class:`~speedtronic.train.sync.NodeSync`). ``_after_step``
advances the counters and the LR schedule, the ``train_step`` metric is emitted,
``checkpoint.maybe_save`` saves on the interval
(:class:`~speedtronic.train.state.TrainerCheckpoint`) after ``_maybe_evaluate`` scored the held-out
set (``eval.every_steps``, and at the end after the coordinator stopped; the evaluations go
into the checkpoints, :class:`~speedtronic.train.state.EvalHistory`). Skipped updates
(GradScaler overflow, non-finite loss with ``run.stop_on_nonfinite: false``) advance nothing; 20
in a row is an error.

``request_stop(reason)`` may be called from a signal handler or another thread: the loop stops
at the next update boundary, stops the coordinator, saves a final checkpoint and returns a
``TrainResult`` whose ``stopped_reason`` is set. ``last_heartbeat`` (``time.monotonic()``) is
refreshed after every update for liveness probes.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from speedtronic.checkpoint import CheckpointManager, CheckpointParts, RNGState
from speedtronic.config import SpeedtronicConfig
from speedtronic.config.schema import config_warnings
from speedtronic.json_types import JSON, JSONView, StateDict
from speedtronic.metrics.logger import MetricLogger, memory_usage_bytes
from speedtronic.train.evaluate import evaluate
from speedtronic.train.features import (
    apply_gradient_checkpointing,
    compile_model,
    make_ooo_scheduler,
)
from speedtronic.train.forward import (
    Batch,
    batch_size_and_tokens,
    call_model,
    move_to_device,
    read_update_values,
    resolve_loss,
)
from speedtronic.train.parallel import SingleProcess
from speedtronic.train.precision import (
    autocast_context,
    make_grad_scaler,
    parameter_count,
    resolve_precision,
)
from speedtronic.train.result import (
    MAX_CONSECUTIVE_SKIPS,
    GradientOverflowError,
    LegacyTrainerKeywords,
    NonFiniteLossError,
    StartStop,
    StepUpdate,
    SyncCoordinator,
    TrainerOptions,
    TrainResult,
    as_sync_coordinator,
    with_legacy_keywords,
)
from speedtronic.train.state import (
    DataPosition,
    EvalHistory,
    TrainerCheckpoint,
    TrainProgress,
    check_resumable,
)
from speedtronic.train.sync import NodeSync

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler
    from typing_extensions import Unpack

    from speedtronic.train.ooo import StageStreamScheduler

__all__ = [
    "GradientOverflowError",
    "NonFiniteLossError",
    "SpeedtronicTrainer",
    "SyncCoordinator",
    "TrainResult",
    "Trainer",
    "TrainerOptions",
    "TrainingEngine",
]


class Trainer:
    """Runs optimizer updates of ``model`` on ``dataloader`` batches (see the module docstring).

    ``config`` (a ``SpeedtronicConfig``, a dict for ``SpeedtronicConfig.from_dict``, or ``None``
    for the defaults) supplies accumulation, clipping, precision, compile, gradient checkpointing,
    OOO, eval cadence and stop policy, so a plain ``nn.Module``, a ``torch.optim`` optimizer and a
    list of batches are enough. Without a config there is no startup shape validation and no eval
    cadence (held-out eval only at the end).

    ``logger`` defaults to a stdout ``MetricLogger``; ``checkpoint_manager``, ``coordinator``
    (a :class:`SyncCoordinator`, or a 2.0.0-style :class:`StartStop` one) and ``scheduler`` are
    optional. ``options`` (:class:`TrainerOptions`) holds the rest: the step target
    (``max_steps``, default ``run.max_steps``) and ``start_step``, ``precision``,
    ``shape_report``, ``accumulation_steps``, ``heldout`` (``eval`` events) and ``parallel``
    (one rank of a data-parallel node: the model is wrapped, gradients sync on the last
    micro-batch and the ranks agree after every update). 2.0.0's ``max_steps=``,
    ``start_step=``, ``precision=`` and ``shape_report=`` keywords still work and warn
    (``DeprecationWarning``).

    The trainer owns two helpers: ``checkpoint`` (:class:`TrainerCheckpoint`: the registered
    checkpoint parts, when they are written, resume) and ``sync`` (:class:`NodeSync`: the
    coordinator seam and the node's ranks).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        dataloader: Iterable[Batch],
        *,
        device: str | torch.device = "cpu",
        config: SpeedtronicConfig | JSONView | None = None,
        scheduler: LRScheduler | None = None,
        logger: MetricLogger | None = None,
        checkpoint_manager: CheckpointManager | None = None,
        coordinator: SyncCoordinator | StartStop | None = None,
        options: TrainerOptions | None = None,
        **legacy: Unpack[LegacyTrainerKeywords],
    ) -> None:
        options = options if options is not None else TrainerOptions()
        if legacy:  # 2.0.0's max_steps=, start_step=, precision=, shape_report=, kept working
            options = with_legacy_keywords(options, legacy)
        configured = config is not None
        if isinstance(config, Mapping):
            config = SpeedtronicConfig.from_dict(config)
        self.config: SpeedtronicConfig = config if config is not None else SpeedtronicConfig()
        self.model = model
        self.optimizer = optimizer
        self.dataloader = dataloader
        self.data = DataPosition(dataloader)
        self.device = torch.device(device)
        self.scheduler = scheduler
        self.logger = logger if logger is not None else MetricLogger()
        self.precision = options.precision or resolve_precision(self.config.precision, self.device)
        self.scaler = make_grad_scaler(self.precision)
        max_steps = options.max_steps
        self.max_steps = int(max_steps if max_steps is not None else self.config.run.max_steps)
        self.step = int(options.start_step)
        self.samples = 0
        self.tokens = 0
        self.skipped_updates = 0
        self.last_heartbeat = time.monotonic()
        self.shape_report = options.shape_report
        # micro-batches per update
        self.accumulation_steps = max(
            1, options.accumulation_steps or self.config.accumulation_steps
        )
        self._model_name = self.config.model.name if configured else type(model).__name__
        self._eval_every = self.config.eval.every_steps if configured else 0
        self._shapes_validated = options.shape_report is not None or not configured
        self._params: list[torch.nn.Parameter] = []
        self._stop_reason: str | None = None  # the stop in effect (agreed by every rank)
        self._stop_request: str | None = None  # a stop asked of this rank
        self.parallel = options.parallel if options.parallel is not None else SingleProcess()
        self.sync = NodeSync(
            as_sync_coordinator(coordinator),
            self.parallel,
            reset_inner_optimizer=self.config.distributed.reset_inner_optimizer,
        )
        self._ooo: StageStreamScheduler | None = None
        self._consecutive_skips = 0
        self.heldout = options.heldout
        self._evaluated_at: int | None = None  # the step of the last eval
        self.evals = EvalHistory()  # every eval event, carried by the checkpoints
        self.logger.hooks.append(self.evals)
        apply_gradient_checkpointing(self.model, self.config.gradient_checkpointing, self.logger)
        self._wrapped = self.parallel.wrap(model)  # DDP/FSDP on several ranks, else the model
        self._active, self._compiled = compile_model(
            self._wrapped, self.config.compile, self.logger
        )
        self._setup_ooo()
        # what a checkpoint saves and resume loads, in load order (under FSDP the model and
        # optimizer parts hold the full, unsharded state)
        model_part, optimizer_part = self.parallel.checkpoint_parts(model, optimizer)
        parts = CheckpointParts(
            {
                "train": TrainProgress(self),
                "model": model_part,
                "optimizer": optimizer_part,
                "scheduler": scheduler,
                "scaler": self.scaler,
                "data": self.data,
                "evals": self.evals,
                "rng": RNGState(),
                "coordinator": self.sync.coordinator,
            },
            root="train",
        )
        self.checkpoint = TrainerCheckpoint(
            parts,
            checkpoint_manager,
            model=model,
            optimizer=optimizer,
            config=self.config,
            precision=self.precision,
            logger=self.logger,
            is_main=self.parallel.is_main,
        )

    # ------------------------------------------------------------------ settings

    @property
    def coordinator(self) -> SyncCoordinator | None:
        """The sync coordinator (``sync.coordinator``), or ``None``."""
        return self.sync.coordinator

    @property
    def checkpoint_manager(self) -> CheckpointManager | None:
        """The checkpoint manager (``checkpoint.manager``), or ``None``."""
        return self.checkpoint.manager

    @property
    def stop_requested(self) -> str | None:
        """The pending stop reason, or ``None``."""
        return self._stop_reason or self._stop_request

    def request_stop(self, reason: str = "requested") -> None:
        """Stop at the next update boundary (safe from signal handlers and other threads); the
        ranks of a node stop together, after the update that follows the request."""
        if self._stop_request is None:
            self._stop_request = str(reason)
        if self._stop_reason is None and self.parallel.stops_locally:
            self._stop_reason = str(reason)
        self.sync.interrupt()  # a coordinator waiting for a global stops waiting

    @property
    def last_heartbeat(self) -> float:
        """``time.monotonic()`` of the last sign of life: an applied update, or a coordinator
        that is waiting for its round (liveness probes read this)."""
        return self.sync.heartbeat(self._heartbeat)

    @last_heartbeat.setter
    def last_heartbeat(self, value: float) -> None:
        self._heartbeat = float(value)

    # ------------------------------------------------------------------ setup

    def _setup_ooo(self) -> None:
        if self._ooo is None:
            self._ooo = make_ooo_scheduler(
                self.model,
                self.device,
                self.logger,
                enabled=self.config.ooo_backprop,
                num_streams=self.config.ooo_streams,
                compiled=self._compiled,
            )

    def _validate_shapes_once(self) -> None:
        if self._shapes_validated:
            return
        from speedtronic.train.shapes import validate_startup_shapes

        self.shape_report = validate_startup_shapes(
            self.config, self.model, self.device, self.precision, logger=self.logger
        )
        self._shapes_validated = True

    # ------------------------------------------------------------------ the loop

    def fit(self, max_steps: int | None = None) -> TrainResult:
        """Train until the absolute step target (or a stop request); see the module docstring."""
        limit = self.max_steps if max_steps is None else int(max_steps)
        if limit <= 0:
            raise ValueError("max_steps must be positive")
        target = max(self.step, limit)
        self.model.to(self.device)
        self.model.train()
        self._setup_ooo()
        self._validate_shapes_once()
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer.zero_grad(set_to_none=True)
        started = time.perf_counter()
        start = (self.step, self.samples, self.tokens)
        metrics: list[JSON] = []
        final_loss: float | None = None
        self.last_heartbeat = time.monotonic()
        trains = self.sync.trains
        if not trains:  # a pure DiLoCo aggregator: no local steps, only its rounds
            target = self.step
        try:
            self.checkpoint.start()  # --overwrite: the old run's checkpoints go now
            # also at (or past) the target: a resumed master serves the rounds still open
            self.parallel.refresh_mirror(self.model)  # FSDP + DiLoCo: what the round sees
            self.sync.start(self.optimizer, self.step)
            self._stop_if_run_ended()
            self.parallel.broadcast_model(self.model)  # every rank starts from rank 0's weights
            self._emit_train_start(target)
            self._maybe_evaluate(target)
            last_tick = started
            while self.step < target and self._stop_reason is None:
                update = self._train_step()
                self._agree(update)
                if update.skipped:
                    self._note_skipped(update)
                    continue
                self._after_step(update)
                self._stop_if_run_ended()
                metric, last_tick = self._step_metric(update, start, started, last_tick)
                self.logger.emit("train_step", metric)
                metrics.append(metric)
                final_loss = update.loss
                self._maybe_evaluate(target)  # first: the checkpoint carries this eval
                self.checkpoint.maybe_save(self.step)
            reached = self.step >= self.max_steps or not trains
            if reached and self._stop_reason is None:
                self._finish_run()
            self._check_replicas()
        finally:
            self.sync.stop()
            if self._ooo is not None:
                self._ooo.dispose()
                self._ooo = None
        stopped = self._stop_reason
        if stopped is not None:
            self.logger.emit("train_stopped", {"step": self.step, "reason": stopped})
        self._maybe_evaluate(target, final=True)
        self.checkpoint.save_final(self.step, stopped=stopped is not None)
        elapsed = time.perf_counter() - started
        self._stop_reason = self._stop_request = None
        self.logger.emit(
            "train_end", {"steps": self.step, "elapsed_s": elapsed, "loss": final_loss}
        )
        return TrainResult(
            steps=self.step,
            samples=self.samples,
            tokens=self.tokens,
            final_loss=final_loss,
            elapsed_s=elapsed,
            metrics=metrics,
            stopped_reason=stopped,
            skipped_updates=self.skipped_updates,
        )

    train = fit

    def _stop_if_run_ended(self) -> None:
        """The exchange's run ended without this node (it arrived after the final global, or
        was dropped): stop with the coordinator's reason, like a stop request."""
        reason = self.sync.run_ended()
        if reason and self._stop_request is None:
            self.request_stop(reason)

    def _agree(self, update: StepUpdate) -> None:
        """Make ``update`` the node's (:meth:`NodeSync.agree`); when some rank of the node was
        asked to stop, every rank stops after this update."""
        stop = self.sync.agree(
            update, self.model, self.optimizer, stop_asked=self._stop_request is not None
        )
        if stop and self._stop_reason is None:
            self._stop_reason = self._stop_request or "stop requested on another rank"

    def _finish_run(self) -> None:
        """The run reached its target: the coordinator's end of run (DiLoCo: the last
        contribution, then the final global), which every rank then takes."""
        self.parallel.refresh_mirror(self.model)
        finishing = self.sync.started or self.config.distributed.enabled
        self.sync.finish()
        self.parallel.broadcast_model(self.model)  # the final global, to every rank
        if finishing:  # every rank of the node alike: the save gathers from all
            self.checkpoint.weights_replaced(self.step)  # the last checkpoint is stale

    def _check_replicas(self) -> None:
        """Several ranks: their replicas must be identical (``replicas`` event, a warning
        when they differ); one process: nothing."""
        spread = self.parallel.replica_spread(self.model)
        if spread is not None:
            self.logger.emit("replicas", {"step": self.step, "spread": spread})
            if spread:
                self.logger.warning("the ranks' replicas differ (spread %g)", spread)

    def _train_step(self) -> StepUpdate:
        """Forward/backward K micro-batches, read loss/norm/tokens in one sync, then update."""
        k = self.accumulation_steps
        losses: list[torch.Tensor] = []
        samples, tokens = 0, 0
        token_tensors: list[torch.Tensor] = []
        for index in range(k):
            batch = move_to_device(self.data.next_batch(), self.device)
            count, counted = batch_size_and_tokens(batch)
            samples += count
            if isinstance(counted, torch.Tensor):
                token_tensors.append(counted)
            else:
                tokens += counted
            with self.parallel.accumulating(final=index == k - 1):  # ranks sync the last one
                loss = self._forward(batch)
                losses.append(loss.detach())
                self._backward(loss / k if k > 1 else loss)
        grad_norm = self._unscale_and_clip()
        loss_value, norm_value, mask_tokens = read_update_values(
            losses, grad_norm, token_tensors, self.device
        )
        update = StepUpdate(loss_value, norm_value, samples, tokens + mask_tokens, k)
        if not self.parallel.finite(loss_value, norm_value):
            self.optimizer.zero_grad(set_to_none=True)
            self.logger.emit("nonfinite_loss", {"step": self.step + 1, "loss": loss_value})
            if self.config.run.stop_on_nonfinite:
                raise NonFiniteLossError(self.step + 1, loss_value)
            update.skipped = "nonfinite_loss"
            return update
        if not self._optimizer_step():
            update.skipped = "grad_scaler_overflow"
        return update

    def _forward(self, batch: Batch) -> torch.Tensor:
        """One micro-batch forward (autocast, OOO bracket, compile fallback) → scalar loss."""
        if self._ooo is not None:
            self._ooo.begin()
        try:
            with autocast_context(self.precision, self.device):
                try:
                    output = call_model(self._active, batch)
                except Exception as exc:
                    if not self._compiled:
                        raise
                    self._active, self._compiled = self._wrapped, False
                    self.logger.emit(
                        "compile",
                        {"enabled": False, "reason": f"runtime failure; disabled: {exc}"},
                    )
                    output = call_model(self.model, batch)
        finally:
            if self._ooo is not None:
                self._ooo.finish()
        return resolve_loss(output, batch, model_name=f"model '{self._model_name}'")

    def _backward(self, loss: torch.Tensor) -> None:
        # torch declares Tensor.backward without annotations: mypy calls it untyped
        if self.scaler is not None:
            self.scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
        else:
            loss.backward()  # type: ignore[no-untyped-call]

    def _unscale_and_clip(self) -> torch.Tensor | None:
        """Unscale (fp16), clip to ``optimizer.grad_clip`` when set; return the global grad norm."""
        params = [p for p in self._params if p.grad is not None]
        grads = [p.grad for p in params if p.grad is not None]  # the same (narrowed for mypy)
        if not params:
            return None
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        clip = self.config.optimizer.grad_clip
        if clip is not None:
            return self.parallel.local_norm(torch.nn.utils.clip_grad_norm_(params, clip))
        return self.parallel.local_norm(torch.nn.utils.get_total_norm(grads))

    def _optimizer_step(self) -> bool:
        """Apply the update; False when the GradScaler skipped it (overflow)."""
        applied = True
        if self.scaler is not None:
            before = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            applied = self.scaler.get_scale() >= before
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return applied

    def _note_skipped(self, update: StepUpdate) -> None:
        self.skipped_updates += 1
        self._consecutive_skips += 1
        self.last_heartbeat = time.monotonic()  # alive, even if this update was skipped
        self.logger.emit(
            "optimizer_step_skipped", {"step": self.step + 1, "reason": update.skipped}
        )
        if self._consecutive_skips >= MAX_CONSECUTIVE_SKIPS:
            scale = self.scaler.get_scale() if self.scaler is not None else None
            raise GradientOverflowError(
                f"{self._consecutive_skips} consecutive updates were skipped at step "
                f"{self.step + 1} (last reason: {update.skipped}; loss scale {scale}); the "
                "gradients overflow every time - lower optimizer.lr, check the data, or use "
                "precision bf16/fp32"
            )

    def _after_step(self, update: StepUpdate) -> None:
        """Count the applied update and step the LR schedule (a DiLoCo coordinator runs its
        round from a hook on ``optimizer.step``, see ``NodeSync.start``)."""
        self._consecutive_skips = 0
        self.samples += update.samples
        self.tokens += update.tokens
        self.step += 1
        if self.scheduler is not None:
            self.scheduler.step()
        self.last_heartbeat = time.monotonic()

    def _maybe_evaluate(self, target: int, *, final: bool = False) -> None:
        """Emit ``eval`` for the local weights at multiples of ``eval.every_steps`` and at the end.

        With a coordinator the target step is left to the final eval, which sees a global
        installed at stop; without one the weights at the target are final, so the target is
        scored in the loop, before its checkpoint is written (which then carries it), and the
        final eval does not score the same weights again."""
        if self.heldout is None:
            return
        local = self.sync.coordinator is None
        if final and local and self._evaluated_at == self.step:
            return
        every, at_target = self._eval_every, self.step >= target
        on_cadence = every > 0 and not self.step % every and not at_target
        if not (final or (local and at_target) or on_cadence):
            return
        result = evaluate(self.model, self.heldout, device=self.device, precision=self.precision)
        self._evaluated_at = self.step
        self.logger.emit("eval", {"step": self.step, **result.as_dict(), "scope": "local"})

    def _step_metric(
        self, update: StepUpdate, start: tuple[int, int, int], started: float, last_tick: float
    ) -> tuple[JSON, float]:
        now = time.perf_counter()
        wall = max(now - started, 1e-9)
        metric: JSON = {
            "step": self.step,
            "loss": update.loss,
            "lr": float(self.optimizer.param_groups[0].get("lr", 0.0)),
            "grad_norm": update.grad_norm,
            "steps_per_sec": (self.step - start[0]) / wall,
            "samples_per_sec": (self.samples - start[1]) / wall,
            "tokens_per_sec": (self.tokens - start[2]) / wall,
            "samples": self.samples,
            "tokens": self.tokens,
            "micro_batches": update.micro_batches,
            "step_time_s": now - last_tick,
        }
        if self.device.type != "cpu":
            memory = memory_usage_bytes(self.device)
            if memory is not None:
                metric["memory_bytes"] = memory
        return metric, now

    def _emit_train_start(self, target: int) -> None:
        import speedtronic

        if self.scheduler is not None:  # the lines `speedtronic validate` prints too
            for message in config_warnings(self.config):
                self.logger.warning("%s", message)
        report = self.shape_report
        self.logger.emit(
            "train_start",
            {
                "start_step": self.step,
                "target_step": target,
                "device": str(self.device),
                "precision": self.precision.mode,
                "accumulation_steps": self.accumulation_steps,
                "ranks": self.parallel.world_size,
                "data_parallel": self.parallel.mode,
                "parameters": parameter_count(self.model),
                "shape_alignment": report.profile.alignment if report is not None else None,
                "shape_warning_count": report.warning_count if report is not None else 0,
                "ooo_backprop": self._ooo.as_dict() if self._ooo is not None else None,
                "compiled": self._compiled,
                "speedtronic_version": speedtronic.__version__,
                "torch_version": str(torch.__version__),
            },
        )

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self) -> Path | None:
        """Save the full training state for the current step; emits ``checkpoint_saved``.

        On a data-parallel node only rank 0 writes (the others return ``None``)."""
        return self.checkpoint.save(self.step)

    def state_dict(self) -> StateDict:
        """Everything needed for an exact resume (tensors and primitive containers only)."""
        return self.checkpoint.state_dict()

    def check_resumable(self, state: StateDict) -> None:
        """:func:`~speedtronic.train.state.check_resumable` for this trainer's model and
        optimizer: ``CheckpointError`` naming the mismatch, nothing changed."""
        check_resumable(state, self.model, self.optimizer)

    def resume(self, state: StateDict) -> None:
        """Load a checkpoint state into every registered part, in place.

        ``CheckpointError`` (nothing changed) when :meth:`check_resumable` rejects it."""
        self.checkpoint.resume(state, counters=self)


TrainingEngine = Trainer
SpeedtronicTrainer = Trainer
