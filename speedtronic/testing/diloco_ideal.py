"""DiLoCo's arithmetic run exactly in one process: the peer the real protocol is measured against.

:func:`simulate` builds one trainer per node id exactly as ``speedtronic train`` builds that
node (same config, same model init, same per-node data stream, same inner optimizer and LR
schedule, kept across rounds), then repeats: every node trains ``inner_steps`` steps; the
pseudo-gradients ``global - local`` (float32) are encoded as the wire carries them
(``distributed.delta_dtype``: fp32 exactly; bf16/fp16 cast; int8/int4 blockwise codes, see
:func:`speedtronic.diloco.codec.encode_delta`), each node keeping what the encoding left
out and adding it to its next pseudo-gradient (error feedback, as
:class:`~speedtronic.diloco.node.DiLoCoNode` does); the decoded values are summed in node-id
order and divided by K. One outer step updates the global
(:class:`~speedtronic.diloco.master.NesterovOuterOptimizer`, the master's own class): lr 1 and
no momentum (``outer_step: average``), ``outer_lr``/``outer_momentum`` (``nesterov``), or lr
eta from the decoded contributions (``adaptive``,
:func:`speedtronic.diloco.master.adaptive_eta`); its update is quantized as the master
sends it when ``distributed.global_dtype`` is int8/int4
(:func:`speedtronic.diloco.master.step_quantized`, with the master's error feedback).
In the rounds ``sync_inner_momentum`` names, every node's AdamW first moment travels in
``delta_dtype`` (no error feedback), the decoded moments are averaged in node order, the mean
travels back in ``delta_dtype`` and every node installs it. Every node continues from the
global; the result is the mean of the last ``final_average`` globals. No files, threads or
timing.

With ``sync: blocking`` and every node delivering in every round, the real processes compute
the same numbers (up to thread-count effects on matmul reductions); any gap is what the
protocol loses. ``bench/diloco_quality.py`` and the end-to-end tests compare against it.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from speedtronic.diloco.codec import (
    cpu_state_dict,
    decode_value,
    encode_delta,
    fragments_of,
)
from speedtronic.diloco.exchange import RoundSettings, syncs_momentum
from speedtronic.diloco.master import (
    NesterovOuterOptimizer,
    NormTally,
    adaptive_eta,
    average_states,
    squared_norm,
    step_quantized,
)
from speedtronic.diloco.node import (
    first_moments,
    float_state,
    install_first_moments,
    merge_state,
)

if TYPE_CHECKING:
    from speedtronic.config import DistributedConfig, SpeedtronicConfig
    from speedtronic.train.evaluate import HeldOut
    from speedtronic.train.runtime import ConfigSource
    from speedtronic.train.trainer import Trainer

__all__ = ["IdealResult", "RecentGlobals", "simulate"]

State = dict[str, torch.Tensor]


class RecentGlobals:
    """The last ``n`` globals, for ``distributed.final_average``: :meth:`push` each global as it
    is made (global 0 included), :meth:`final` gives the mean of those held (fewer than ``n``
    before ``n`` rounds). Holds ``n - 1`` copies besides the caller's (none for ``n == 1``)."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError("final_average must be >= 1")
        self.n = n
        self._held: deque[dict[str, torch.Tensor]] = deque(maxlen=n - 1)
        self._last: Mapping[str, torch.Tensor] | None = None

    def push(self, state: Mapping[str, torch.Tensor]) -> None:
        """Record the newest global (copied when it is not the last one kept)."""
        if self._last is not None and self.n > 1:
            self._held.append({k: v.detach().clone() for k, v in self._last.items()})
        self._last = {k: v.detach().clone() for k, v in state.items()} if self.n > 1 else state

    def final(self) -> dict[str, torch.Tensor]:
        """The mean of the held globals, oldest first; the last global itself when n == 1."""
        if self._last is None:
            raise ValueError("no global pushed")
        if self.n == 1:
            return {k: v.detach().clone() for k, v in self._last.items()}
        return average_states([*self._held, self._last])


_OUTER = ("outer_step", "outer_lr", "outer_momentum")


@dataclasses.dataclass
class IdealResult:
    """Outcome of :func:`simulate`.

    ``global_state``: the final model (the mean of the last ``final_average`` globals);
    ``outer_steps``: rounds run; ``eval_loss``: held-out loss of the final model (None without
    held-out data); ``curve``: ``(outer_step, loss)`` of each round's global when
    ``eval_every_round``; ``node_losses``: each node's last train loss; ``etas``: each round's
    outer lr (1.0 for ``average``); ``momentum_syncs``: rounds that averaged the first moment.
    """

    global_state: State
    outer_steps: int
    eval_loss: float | None
    curve: list[tuple[int, float]]
    node_losses: dict[str, float | None]
    etas: list[float] = dataclasses.field(default_factory=list)
    momentum_syncs: int = 0


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
    config: ConfigSource,
    node_ids: Sequence[str],
    *,
    inner_steps: int | None = None,
    outer_step: str | None = None,
    outer_lr: float | None = None,
    outer_momentum: float | None = None,
    adaptive_c: float | None = None,
    adaptive_max: float | None = None,
    final_average: int | None = None,
    sync_inner_momentum: str | None = None,
    inner_momentum_every: int | None = None,
    delta_dtype: str | None = None,
    block_size: int | None = None,
    error_feedback: bool | None = None,
    global_dtype: str | None = None,
    sync: str | None = None,
    overlap_steps: int | None = None,
    fragments: int | None = None,
    eval_every_round: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> IdealResult:
    """Run K = ``len(node_ids)`` nodes of ``config`` in lockstep (see the module docstring).

    Every keyword defaults to the ``distributed`` field of its name (``block_size``:
    ``delta_block_size``). ``outer_lr`` or ``outer_momentum`` without ``outer_step`` means
    ``nesterov``, as in a config; an outer setting given here also replaces the config's
    ``final_average`` (unless given too), which then follows the outer step as in a config
    (2 with ``adaptive``, else 1). Without error feedback what the wire format leaves out is
    lost. Each node trains ``config.effective_max_steps`` steps; the last round is shorter
    when that is not a multiple of ``inner_steps``. ``progress(round, rounds)`` is called
    after each round.
    """
    from speedtronic.config import SpeedtronicConfig
    from speedtronic.train.evaluate import build_heldout
    from speedtronic.train.runtime import build_runtime

    if not isinstance(config, SpeedtronicConfig):
        config = SpeedtronicConfig.load(config)
    s = _settings(
        config.distributed,
        inner_steps=inner_steps,
        outer_step=outer_step,
        outer_lr=outer_lr,
        outer_momentum=outer_momentum,
        adaptive_c=adaptive_c,
        adaptive_max=adaptive_max,
        final_average=final_average,
        sync_inner_momentum=sync_inner_momentum,
        inner_momentum_every=inner_momentum_every,
        delta_dtype=delta_dtype,
        delta_block_size=block_size,
        error_feedback=error_feedback,
        global_dtype=global_dtype,
        sync=sync,
        overlap_steps=overlap_steps,
        fragments=fragments,
    )
    wire, block, global_wire = s.delta_dtype, s.delta_block_size, s.global_dtype
    global_residual: State = {}
    quiet = _quiet(config)
    ids = sorted(node_ids)
    nodes = [_Node(build_runtime(quiet, node_id=node)[0]) for node in ids]
    model = nodes[0].trainer.model
    global_state = cpu_state_dict(model.state_dict())
    optimizer = NesterovOuterOptimizer(global_state, s.outer_lr, s.outer_momentum)
    recent = RecentGlobals(s.final_average)
    recent.push(global_state)
    heldout = build_heldout(config)
    plan = _Plan.of(s, config.effective_max_steps, model)
    result = IdealResult({}, plan.rounds, None, [], {})
    merges: list[tuple[int, tuple[str, ...] | None]] = []  # overlapped: (step, tensors)
    for r in range(plan.rounds):
        target, keys, last = plan.target(r), plan.keys(r), r + 1 == plan.rounds
        due = [m for m in merges if m[0] <= target]  # the rest: in flight at the final one
        merges = [] if last else [m for m in merges if m not in due]  # which carries them
        mean: State = {}
        tally = NormTally()
        for node_id, node in zip(ids, nodes, strict=True):
            for step, part in due:  # as the node: at its step, the tensors its round synced
                node.train_to(min(step, target))
                node.merge(global_state if part is None else {k: global_state[k] for k in part})
            result.node_losses[node_id] = node.train_to(target)
            delta = node.contribute(keys, wire, block, s.error_feedback)
            for value in delta.values():  # what the master reads, tensor by tensor
                tally.add(value)
            tally.close()
            for key, value in delta.items():
                mean[key] = value if key not in mean else mean[key].add_(value)
        for value in mean.values():
            value.div_(float(len(ids)))
        if s.outer_step == "adaptive":
            eta = adaptive_eta(
                tally.spread, squared_norm(mean), tally.count, s.adaptive_c, s.adaptive_max
            )
            optimizer.lr = eta
        result.etas.append(optimizer.lr)
        if global_wire == "fp32":
            optimizer.step(global_state, mean)
        else:
            step_quantized(
                optimizer,
                global_state,
                mean,
                global_residual,
                dtype=global_wire,
                block_size=block,
                error_feedback=s.error_feedback,
            )
        recent.push(global_state)
        if syncs_momentum(s.sync_inner_momentum, s.inner_momentum_every, r + 1):
            _sync_momentum([node.trainer for node in nodes], wire, block)
            result.momentum_syncs += 1
        ending = r >= plan.trained  # a round that ends the run: no global merged but the last
        if plan.overlap_steps and not last and not ending:  # merged overlap_steps later
            merges.append((target + plan.overlap_steps, keys))
        elif last or not ending:  # blocking (and every node's last): merged at once
            for node in nodes:
                node.merge(global_state)
        if eval_every_round and heldout is not None:
            result.curve.append((r + 1, _score(nodes[0].trainer, global_state, heldout)))
        if progress is not None:
            progress(r + 1, plan.rounds)
    final = recent.final()
    if heldout is not None:
        last_scored = eval_every_round and s.final_average == 1
        result.eval_loss = result.curve[-1][1] if last_scored else None
        if result.eval_loss is None:
            result.eval_loss = _score(nodes[0].trainer, final, heldout)
    for node in nodes:
        node.trainer.logger.close()
    result.global_state = cpu_state_dict(final)
    return result


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The rounds of a run: ``round_steps`` = ``inner_steps / fragments`` steps each (the
    last shorter when the run is not a multiple), round ``r`` syncing fragment
    ``r % fragments`` (``parts``; None: every tensor) and, with fragments, the rounds that
    end the run: the schedule's next ones, with no step between them, until every fragment
    was synced since the last step (a node's final contributions, the last one final); an
    overlapped node merges a round's global ``overlap_steps`` after its contribution (0:
    blocking, at once), the tensors the round synced, and no global of the ending rounds but
    the last."""

    total_steps: int
    round_steps: int
    overlap_steps: int
    parts: list[tuple[str, ...]] | None

    @classmethod
    def of(cls, s: DistributedConfig, total_steps: int, model: torch.nn.Module) -> _Plan:
        """The plan of ``s`` for a run of ``total_steps`` steps of ``model``."""
        rules = RoundSettings.of(s).rules  # the nodes' own reading of the section
        state = model.state_dict()
        parts = fragments_of(state, s.fragments) if s.fragments > 1 else None
        return cls(total_steps, rules.round_steps, rules.overlap_steps, parts)

    @property
    def rounds(self) -> int:
        """Rounds of training, and with fragments the rounds that end the run."""
        if self.parts is None:
            return math.ceil(self.total_steps / self.round_steps)
        on_boundary = self.total_steps % self.round_steps == 0
        return self.total_steps // self.round_steps + len(self.parts) - int(on_boundary)

    @property
    def trained(self) -> int:
        """The rounds taken at a boundary of training; those after them end the run."""
        return self.rounds if self.parts is None else self.total_steps // self.round_steps

    def target(self, r: int) -> int:
        """The step at which round ``r``'s contribution is taken."""
        return min((r + 1) * self.round_steps, self.total_steps)

    def keys(self, r: int) -> tuple[str, ...] | None:
        """The tensors round ``r`` syncs (None: every one): with fragments, the fragment of
        the schedule, also in the rounds that end the run (each fragment once more since the
        last step: every one but the fragment synced at that step, or all of them when the
        run ended between rounds)."""
        if self.parts is None:
            return None
        return self.parts[r % len(self.parts)]


class _Node:
    """One node's trainer and its round state: the float32 anchor its contributions are
    measured from and the residual the wire format left out (the arithmetic of
    :class:`~speedtronic.diloco.node.DiLoCoNode` without its files and threads)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        trainer.heldout = None  # the global is what is scored
        self.anchor = float_state(trainer.model)
        self.residual: State = {}
        self.loss: float | None = None

    def train_to(self, step: int) -> float | None:
        """Train up to absolute ``step``; the last train loss so far."""
        if step > self.trainer.step:
            self.loss = self.trainer.fit(step).final_loss
        return self.loss

    def contribute(
        self, keys: Sequence[str] | None, wire: str, block: int, error_feedback: bool
    ) -> State:
        """``anchor - weights`` (+ the residual) of ``keys`` as the master decodes it; the
        anchor of those keys becomes the weights (the node trains on from its own)."""
        current = float_state(self.trainer.model)
        delta = {}
        for key in self.anchor if keys is None else keys:
            delta[key] = self.anchor[key] - current[key]
            self.anchor[key] = current[key]
        sent, residual = _sent(delta, self.residual, wire, block, error_feedback)
        self.residual.update(residual)
        return sent

    def merge(self, state: State) -> None:
        """``weights := state + (weights - anchor)``, ``anchor := state`` (the node's merge)."""
        merge_state(self.trainer.model, self.anchor, state)


def _settings(section: DistributedConfig, **overrides: object) -> DistributedConfig:
    """``section`` with the ``overrides`` that are not None, resolved as a config is: an
    outer setting given here replaces all three of the section's and its ``final_average``
    (``outer_lr`` alone means ``nesterov``; a conflicting pair is a ConfigError; without a
    ``final_average`` here: 2 with ``adaptive``, else 1)."""
    given = {k: v for k, v in overrides.items() if v is not None}
    values = {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}
    if given.keys() & set(_OUTER):
        for name in (*_OUTER, "final_average"):
            values.pop(name)
    return type(section)(**{**values, **given})


def _through(state: State, wire: str, block: int) -> State:
    """``state`` as the other side decodes it after ``wire`` (no error feedback)."""
    if wire == "fp32":
        return state
    return {k: decode_value(v) for k, v in encode_delta(state, wire, block).items()}


def _sync_momentum(trainers: Sequence[Trainer], wire: str, block: int) -> None:
    """Every node's first moment, sent and decoded, averaged in node order, sent back and
    installed on every node (the master's and the nodes' arithmetic without the files)."""
    sent = [_through(first_moments(t.model, t.optimizer), wire, block) for t in trainers]
    mean = _through(average_states(sent), wire, block)
    for trainer in trainers:
        install_first_moments(trainer.model, trainer.optimizer, mean)


def _sent(
    delta: State, residual: State, wire: str, block: int, error_feedback: bool
) -> tuple[State, State]:
    """What the master adds for one node's ``delta`` (plus the ``residual`` of its keys,
    popped), and the residual of those keys the wire leaves out now: the node's arithmetic
    (``DiLoCoNode._boundary``) without its files."""
    for key, value in delta.items():
        if key in residual:
            value.add_(residual.pop(key))
    if wire == "fp32":
        return delta, {}
    sent = _through(delta, wire, block)
    if not error_feedback:
        return sent, {}
    return sent, {k: v - sent[k] for k, v in delta.items()}


def _score(trainer: Trainer, state: Mapping[str, torch.Tensor], heldout: HeldOut) -> float:
    """Held-out loss of ``state``, on a copy of ``trainer``'s model (an overlapped node's own
    weights are not the global)."""
    from speedtronic.train.evaluate import evaluate

    model = copy.deepcopy(trainer.model)
    _install(model, state)
    return evaluate(model, heldout, device=trainer.device, precision=trainer.precision).loss


@torch.no_grad()
def _install(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    current = model.state_dict()
    for key, value in state.items():
        current[key].copy_(value.to(current[key].device, current[key].dtype))
