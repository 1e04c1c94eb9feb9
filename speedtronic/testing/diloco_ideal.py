"""DiLoCo's arithmetic run exactly in one process: the peer the real protocol is measured against.

:func:`simulate` builds one trainer per node id exactly as ``speedtronic train`` builds that
node (same config, same model init, same per-node data stream, same inner optimizer and LR
schedule, kept across rounds), then repeats: every node trains ``inner_steps`` steps; the
pseudo-gradients ``global - local`` (float32) are encoded as the wire carries them
(``distributed.delta_dtype``: fp32 exactly; bf16/fp16 cast; int8/int4 blockwise codes, see
:func:`speedtronic.diloco.codec.encode_delta`), each node keeping what the encoding left
out and adding it to its next pseudo-gradient (error feedback, as
:class:`~speedtronic.diloco.node.DiLoCoNode` does); the decoded values are summed in node-id
order and divided by K;
one outer step (:class:`~speedtronic.diloco.master.NesterovOuterOptimizer`, the master's own
class) updates the global, its update quantized as the master sends it when
``distributed.global_dtype`` is int8/int4 (:func:`speedtronic.diloco.master.step_quantized`,
with the master's error feedback); every node continues from it. No files, threads or timing.

With ``sync: blocking`` and every node delivering in every round, the real processes compute
the same numbers (up to thread-count effects on matmul reductions); any gap is what the
protocol loses. ``bench/diloco_quality.py`` and the end-to-end tests compare against it.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from speedtronic.diloco.codec import (
    compute_pseudo_gradient,
    cpu_state_dict,
    decode_value,
    encode_delta,
)
from speedtronic.diloco.master import NesterovOuterOptimizer, step_quantized
from speedtronic.diloco.node import float_state

if TYPE_CHECKING:
    from speedtronic.config import SpeedtronicConfig
    from speedtronic.train.evaluate import EvalResult, HeldOut
    from speedtronic.train.trainer import Trainer

__all__ = ["IdealResult", "simulate"]


@dataclasses.dataclass
class IdealResult:
    """Outcome of :func:`simulate`.

    ``global_state``: the final global; ``outer_steps``: rounds run; ``eval_loss``: held-out
    loss of the final global (None without held-out data); ``curve``: ``(outer_step, loss)``
    after every round when ``eval_every_round``; ``node_losses``: each node's last train loss.
    """

    global_state: dict[str, torch.Tensor]
    outer_steps: int
    eval_loss: float | None
    curve: list[tuple[int, float]]
    node_losses: dict[str, float | None]


def _quiet(config: SpeedtronicConfig) -> SpeedtronicConfig:
    """A copy that trains locally: no DiLoCo, no checkpoints, no files, warnings only."""
    config = copy.deepcopy(config)
    config.distributed.enabled = False
    config.checkpoint.enabled = False
    config.logging.level = "WARNING"
    config.logging.json_file = None
    config.logging.file = None
    return config


def simulate(
    config: SpeedtronicConfig,
    node_ids: Sequence[str],
    *,
    inner_steps: int | None = None,
    outer_lr: float | None = None,
    outer_momentum: float | None = None,
    delta_dtype: str | None = None,
    block_size: int | None = None,
    error_feedback: bool | None = None,
    global_dtype: str | None = None,
    eval_every_round: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> IdealResult:
    """Run K = ``len(node_ids)`` nodes of ``config`` in lockstep (see the module docstring).

    ``inner_steps``, ``outer_lr``, ``outer_momentum``, ``delta_dtype``, ``block_size``
    (values per scale of int8/int4), ``error_feedback`` and ``global_dtype`` default to the
    ``distributed`` section; without error feedback what the wire format leaves out is lost.
    Each node trains ``config.effective_max_steps`` steps; the last round is shorter when
    that is not a multiple of ``inner_steps``. ``progress(round, rounds)`` is called after
    each round.
    """
    from speedtronic.config import SpeedtronicConfig
    from speedtronic.train.evaluate import build_heldout, evaluate
    from speedtronic.train.runtime import build_runtime

    if not isinstance(config, SpeedtronicConfig):
        config = SpeedtronicConfig.load(config)
    section = config.distributed
    h = int(inner_steps or section.inner_steps)
    lr = section.outer_lr if outer_lr is None else float(outer_lr)
    momentum = section.outer_momentum if outer_momentum is None else float(outer_momentum)
    wire = str(delta_dtype or section.delta_dtype)
    block = int(block_size or section.delta_block_size)
    if error_feedback is None:
        error_feedback = section.error_feedback
    global_wire = str(global_dtype or section.global_dtype)
    global_residual: dict[str, torch.Tensor] = {}
    quiet = _quiet(config)
    ids = sorted(node_ids)
    trainers = [build_runtime(quiet, node_id=node)[0] for node in ids]
    for trainer in trainers:
        trainer.heldout = None  # the global is what is scored
    model = trainers[0].model
    global_state = cpu_state_dict(model.state_dict())
    outer = NesterovOuterOptimizer(global_state, lr, momentum)
    anchors = [float_state(t.model) for t in trainers]
    residuals: list[dict[str, torch.Tensor] | None] = [None] * len(ids)
    heldout = build_heldout(config)
    total_steps = config.effective_max_steps
    rounds = math.ceil(total_steps / h)
    curve: list[tuple[int, float]] = []
    losses: dict[str, float | None] = {}
    for r in range(rounds):
        target = min((r + 1) * h, total_steps)
        mean: dict[str, torch.Tensor] | None = None
        for i, (node, trainer, anchor) in enumerate(zip(ids, trainers, anchors, strict=True)):
            losses[node] = trainer.fit(target).final_loss
            delta = compute_pseudo_gradient(anchor, float_state(trainer.model))
            delta, residuals[i] = _sent(delta, residuals[i], wire, block, error_feedback)
            if mean is None:
                mean = delta
            else:
                for key, value in delta.items():
                    mean[key].add_(value)
        for value in mean.values():
            value.div_(float(len(ids)))
        if global_wire == "fp32":
            outer.step(global_state, mean)
        else:
            step_quantized(
                outer,
                global_state,
                mean,
                global_residual,
                dtype=global_wire,
                block_size=block,
                error_feedback=error_feedback,
            )
        for i, trainer in enumerate(trainers):
            _install(trainer.model, global_state)
            anchors[i] = float_state(trainer.model)
        if eval_every_round and heldout is not None:
            curve.append((r + 1, _score(model, global_state, heldout, trainers[0], evaluate)))
        if progress is not None:
            progress(r + 1, rounds)
    final = curve[-1][1] if curve else None
    if final is None and heldout is not None:
        final = _score(model, global_state, heldout, trainers[0], evaluate)
    for trainer in trainers:
        trainer.logger.close()
    return IdealResult(cpu_state_dict(global_state), rounds, final, curve, losses)


def _sent(
    delta: dict[str, torch.Tensor],
    residual: dict[str, torch.Tensor] | None,
    wire: str,
    block: int,
    error_feedback: bool,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """What the master adds for one node's ``delta`` (plus its ``residual``), and the node's
    next residual: the node's arithmetic (``DiLoCoNode._boundary``) without its files."""
    if residual is not None:
        delta = {k: v.add_(residual[k]) for k, v in delta.items()}
    if wire == "fp32":
        return delta, None
    encoded = encode_delta(delta, wire, block)
    sent = {k: decode_value(v) for k, v in encoded.items()}
    if not error_feedback:
        return sent, None
    return sent, {k: v - sent[k] for k, v in delta.items()}


def _score(
    model: torch.nn.Module,
    state: dict[str, torch.Tensor],
    heldout: HeldOut,
    trainer: Trainer,
    evaluate: Callable[..., EvalResult],
) -> float:
    _install(model, state)
    return evaluate(model, heldout, device=trainer.device, precision=trainer.precision).loss


@torch.no_grad()
def _install(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    current = model.state_dict()
    for key, value in state.items():
        current[key].copy_(value.to(current[key].device, current[key].dtype))
