"""Data parallelism inside one node: process group, model wrapper, rank agreement.

The ranks of a node (:mod:`speedtronic.train.ranks` starts them) train one model together:

- ``run.data_parallel: ddp`` (default): every rank holds a replica wrapped in
  ``DistributedDataParallel``; gradients are averaged across ranks in the backward of the
  last micro-batch of an update (``no_sync`` on the others).
- ``fsdp``: parameters, gradients and optimizer state are sharded with FSDP2
  (``torch.distributed.fsdp.fully_shard``, per block, then the root), for models that do not
  fit one device. Checkpoints hold the full, unsharded state (gathered to rank 0), so they
  load into any rank count, DDP or a single process.

The trainer talks to one object, created by :func:`start_parallel`: :class:`SingleProcess`
(one rank: no process group, no wrapper, every agreement is the local value) or
:class:`DataParallel`. After every update the ranks make one small ``all_reduce``
(:meth:`DataParallel.agree`) that turns the update into the node's (mean loss, summed samples
and tokens), stops every rank at the same step when any rank was asked to stop, and tells the
other ranks that rank 0's DiLoCo coordinator installed a new global, which rank 0 then
broadcasts (:meth:`DataParallel.broadcast_model`). Only rank 0 talks to the DiLoCo exchange,
writes checkpoints, evaluates (DDP) and logs. Under FSDP rank 0's coordinator works on a full
copy of the model (:meth:`DataParallel.round_model`), gathered at the round's steps and
sharded back after a merge.

Every collective waits at most ``run.collective_timeout`` seconds; a rank that died or hangs
makes the others fail with :class:`RankFailure` instead of hanging.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import nn

from speedtronic.json_types import StateDict
from speedtronic.train.ranks import RankEnv

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import OptimizerStateType, StateDictOptions
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    from speedtronic.checkpoint_parts import Stateful
    from speedtronic.config import RunConfig


_T = TypeVar("_T")

__all__ = [
    "Agreement",
    "DataParallel",
    "FullModelState",
    "FullOptimizerState",
    "RankFailure",
    "SingleProcess",
    "start_parallel",
]


class RankFailure(RuntimeError):
    """A collective failed: another rank of this node died or did not answer in time."""


@dataclass
class Agreement:
    """One update as the whole node sees it (see :meth:`DataParallel.agree`)."""

    loss: float  # mean over ranks
    samples: int  # summed over ranks
    tokens: int  # summed over ranks
    stop: bool  # some rank was asked to stop
    new_global: bool  # rank 0 installed a new DiLoCo global
    wants_weights: bool = False  # rank 0's DiLoCo round reads the weights after this update


class SingleProcess:
    """One rank: the null object (no process group, no wrapper, local values)."""

    rank = 0
    world_size = 1
    is_main = True
    sharded = False
    mode = "single"
    #: a stop request takes effect at once (no other rank to agree with)
    stops_locally = True

    def wrap(self, model: nn.Module) -> nn.Module:
        """``model`` itself."""
        return model

    def accumulating(self, final: bool) -> contextlib.AbstractContextManager[None]:
        """A no-op context around one micro-batch's forward and backward."""
        return contextlib.nullcontext()

    #: the DiLoCo round works on a full copy of the weights (FSDP), see ``round_model``
    mirrored = False

    def agree(
        self,
        loss: float,
        samples: int,
        tokens: int,
        *,
        stop: bool,
        new_global: bool,
        wants_weights: bool = False,
    ) -> Agreement:
        """This update's local values as the whole node sees them (:meth:`_agreed`); one
        process: the local values themselves."""
        return self._agreed(Agreement(loss, samples, tokens, stop, new_global, wants_weights))

    def _agreed(self, local: Agreement) -> Agreement:
        return local

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on some rank (here: the local value)."""
        return flag

    def round_model(self, model: nn.Module, build: Callable[[], nn.Module]) -> nn.Module:
        """The model the DiLoCo coordinator reads and writes: ``model`` itself."""
        return model

    def refresh_mirror(self, model: nn.Module) -> None:
        """Nothing to copy (no mirror)."""

    def finite(self, loss: float, grad_norm: float | None) -> bool:
        """Whether the update may be applied: a finite loss."""
        return math.isfinite(loss)

    def broadcast_model(self, model: nn.Module) -> None:
        """Nothing to send."""

    @property
    def evaluates(self) -> bool:
        """Whether this rank scores the held-out set."""
        return True

    def local_norm(self, norm: torch.Tensor | None) -> torch.Tensor | None:
        """The gradient norm as a plain tensor."""
        return norm

    def replica_spread(self, model: nn.Module) -> float | None:
        """How far the ranks' replicas differ (``None``: nothing to compare)."""
        return None

    def checkpoint_parts(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[Stateful, Stateful]:
        """The checkpoint parts that save and load ``model`` and ``optimizer``: themselves."""
        return model, optimizer

    def close(self) -> None:
        """Nothing to tear down."""


class DataParallel(SingleProcess):
    """One of ``world_size`` ranks of this node, in an initialized process group."""

    stops_locally = False

    def __init__(self, ranks: RankEnv, device: torch.device, mode: str, timeout: float) -> None:
        self.rank = ranks.rank
        self.world_size = ranks.world_size
        self.local_rank = ranks.local_rank
        self.is_main = ranks.is_main
        self.device = device
        self.mode = mode
        self.sharded = mode == "fsdp"
        self.timeout = float(timeout)
        self._wrapper: nn.Module | None = None  # what wrap() returned
        self._ddp: DistributedDataParallel | None = None  # the wrapper (DDP)
        self._fsdp: FSDPModule | None = None  # the root sharded in place (FSDP)
        self.mirror: nn.Module | None = None  # rank 0's full copy (FSDP with DiLoCo)

    # ------------------------------------------------------------------ model

    def wrap(self, model: nn.Module) -> nn.Module:
        """DDP around ``model`` (parameters from rank 0), or FSDP2 sharding in place (which
        replaces the parameters: wrap before building the optimizer). Wrapping again returns
        the same wrapper."""
        if self._wrapper is not None:
            return self._wrapper
        if self.sharded:
            from torch.distributed.fsdp import fully_shard

            for module in list(model.modules()):
                if isinstance(module, nn.ModuleList):  # the transformer blocks
                    for block in module:
                        fully_shard(block)
            self._fsdp = fully_shard(model)
            self._wrapper = model
            return model
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        self._wrapper = self._ddp = DistributedDataParallel(model, device_ids=ids)
        return self._wrapper

    @contextlib.contextmanager
    def accumulating(self, final: bool) -> Iterator[None]:
        """Gradients synchronise only in the backward of the ``final`` micro-batch."""
        if self._fsdp is not None:
            self._fsdp.set_requires_gradient_sync(final)
            yield
        elif self._ddp is not None and not final:
            with self._ddp.no_sync():
                yield
        else:
            yield

    def local_norm(self, norm: torch.Tensor | None) -> torch.Tensor | None:
        """A sharded (DTensor) gradient norm as the full, plain tensor."""
        full = getattr(norm, "full_tensor", None)
        return full() if callable(full) else norm

    def finite(self, loss: float, grad_norm: float | None) -> bool:
        """A finite local loss and a finite gradient norm: the norm is the same on every rank
        (gradients are averaged), so a non-finite loss on one rank skips the update on all."""
        return math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm))

    @property
    def evaluates(self) -> bool:
        """DDP: rank 0 scores the held-out set alone; FSDP: every rank (the forward gathers)."""
        return self.is_main or self.sharded

    # ------------------------------------------------------------------ collectives

    def _agreed(self, local: Agreement) -> Agreement:
        """One ``all_reduce``: node mean loss, node samples and tokens, a stop on any rank, and
        whether rank 0 installed a new global or its round needs the weights."""
        import torch.distributed as dist

        main = self.is_main
        flags = [local.stop, local.new_global and main, local.wants_weights and main]
        values = torch.tensor(
            [*map(float, flags), local.loss, local.samples, local.tokens],
            dtype=torch.float64,
            device=self._collective_device(),
        )
        self._run("all_reduce", lambda: dist.all_reduce(values))
        total_stop, installed, wanted, loss_sum, samples_sum, tokens_sum = values.tolist()
        return Agreement(
            loss_sum / self.world_size,
            int(samples_sum),
            int(tokens_sum),
            total_stop > 0,
            installed > 0,
            wanted > 0,
        )

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on some rank (one small ``all_reduce``)."""
        import torch.distributed as dist

        value = torch.tensor([float(flag)], dtype=torch.float64, device=self._collective_device())
        self._run("all_reduce", lambda: dist.all_reduce(value, op=dist.ReduceOp.MAX))
        return value.item() > 0

    # ------------------------------------------------------------------ FSDP with DiLoCo

    def round_model(self, model: nn.Module, build: Callable[[], nn.Module]) -> nn.Module:
        """The model the DiLoCo coordinator reads and writes (every rank calls this, before
        :meth:`wrap`). DDP: ``model``, a full replica. FSDP: a full copy on rank 0's CPU
        (``build()`` makes the empty module), kept in step at the round's steps only:
        :meth:`refresh_mirror` gathers the shards into it before the round reads it, and
        :meth:`broadcast_model` shards it back into every rank after a global was merged."""
        if not self.sharded:
            return model
        self.mirrored = True
        if not self.is_main:
            return model  # never used: rank 0 alone runs the round
        mirror = build()
        with torch.no_grad():
            mirror.load_state_dict({k: v.detach().cpu() for k, v in model.state_dict().items()})
        self.mirror = mirror
        return mirror

    def refresh_mirror(self, model: nn.Module) -> None:
        """Gather the full weights into rank 0's mirror (every rank calls this; nothing
        without a mirror)."""
        if not self.mirrored:
            return
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        options = _full_options(saving=True)
        full = self._run("gather", lambda: get_model_state_dict(model, options=options))
        if self.mirror is not None:
            with torch.no_grad():
                self.mirror.load_state_dict(full)

    def broadcast_model(self, model: nn.Module) -> None:
        """Every parameter and buffer from rank 0. FSDP: rank 0's mirror, sharded into every
        rank (with DiLoCo; without, the shards are left as they are)."""
        if self.sharded:
            if self.mirrored:
                self._scatter_mirror(model)
            return
        import torch.distributed as dist

        def send() -> None:
            with torch.no_grad():
                for tensor in [*model.parameters(), *model.buffers()]:
                    dist.broadcast(tensor.data, src=0)

        self._run("broadcast", send)

    def _scatter_mirror(self, model: nn.Module) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        full = self.mirror.state_dict() if self.mirror is not None else {}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        self._run("broadcast", lambda: set_model_state_dict(model, full, options=options))

    def replica_spread(self, model: nn.Module) -> float | None:
        """Max minus min over ranks of the sum of every parameter (float64): 0.0 when the
        replicas are identical, as DDP and the global broadcasts keep them. ``None`` for FSDP
        (each rank holds other shards)."""
        if self.sharded:
            return None
        import torch.distributed as dist

        with torch.no_grad():
            zero = torch.zeros((), dtype=torch.float64)
            total = sum((p.detach().double().sum() for p in model.parameters()), zero)
        device = self._collective_device()
        values = torch.stack([total, -total]).to(device, torch.float64)
        self._run("all_reduce", lambda: dist.all_reduce(values, op=dist.ReduceOp.MAX))
        high, neg_low = values.tolist()
        return float(high + neg_low)

    def checkpoint_parts(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[Stateful, Stateful]:
        """DDP: the model and optimizer themselves (every rank holds everything). FSDP:
        :class:`FullModelState` and :class:`FullOptimizerState`, which gather the unsharded
        state on save and shard a full state on load."""
        if not self.sharded:
            return model, optimizer
        return FullModelState(model), FullOptimizerState(model, optimizer)

    def _collective_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def _run(self, what: str, call: Callable[[], _T]) -> _T:
        try:
            return call()
        except Exception as exc:
            cause = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise RankFailure(
                f"rank {self.rank} of {self.world_size}: {what} failed - another rank of this "
                f"node died or did not answer within run.collective_timeout="
                f"{self.timeout:g} s ({cause})"
            ) from exc

    def close(self) -> None:
        """Leave the process group, once every rank got here (a rank that leaves first can
        abort a peer that is still tearing its side down)."""
        import torch.distributed as dist

        if dist.is_initialized():
            self._run("barrier", dist.barrier)
            dist.destroy_process_group()


def _full_options(*, saving: bool) -> StateDictOptions:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=saving)


class FullModelState:
    """An FSDP2 model as a checkpoint part: the full state dict (gathered to rank 0, on the
    CPU; the other ranks get an empty one, they do not write) and a full state dict loaded
    on every rank, each keeping its shard. Parameter names are those of the plain model."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> StateDict:
        """The unsharded ``{name: tensor}`` on rank 0 (every rank must call this)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.model, options=_full_options(saving=True))

    def load_state_dict(self, state: StateDict) -> None:
        """Shard a full state dict into the model (every rank, with the whole dict)."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.model, state, options=_full_options(saving=False))


class FullOptimizerState:
    """An optimizer over FSDP2 parameters as a checkpoint part, in ``torch.optim``'s own
    layout (state and groups keyed by parameter index), so the checkpoint resumes under DDP or
    in one process too. torch's distributed helpers key the full state by parameter name; the
    index of a name is its position in the optimizer's groups, as ``Optimizer.state_dict``
    numbers them."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def _names(self) -> list[str]:
        by_id = {id(p): name for name, p in self.model.named_parameters()}
        return [by_id[id(p)] for group in self.optimizer.param_groups for p in group["params"]]

    def state_dict(self) -> StateDict:
        """The unsharded optimizer state on rank 0, keyed by parameter index."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        full: StateDict = get_optimizer_state_dict(
            self.model, self.optimizer, options=_full_options(saving=True)
        )
        if not full:
            return {}
        index = {name: i for i, name in enumerate(self._names())}
        groups = [
            {**group, "params": [index[name] for name in group["params"]]}
            for group in full["param_groups"]
        ]
        return {"state": {index[k]: v for k, v in full["state"].items()}, "param_groups": groups}

    def load_state_dict(self, state: StateDict) -> None:
        """Shard an index-keyed full optimizer state into this rank's optimizer."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        names = self._names()
        full: OptimizerStateType = {
            "state": {names[int(k)]: v for k, v in state["state"].items()},
            "param_groups": [
                {**group, "params": [names[i] for i in group["params"]]}
                for group in state["param_groups"]
            ],
        }
        set_optimizer_state_dict(
            self.model, self.optimizer, full, options=_full_options(saving=False)
        )


def start_parallel(
    ranks: RankEnv, device: torch.device, run: RunConfig
) -> tuple[SingleProcess, torch.device]:
    """Join the node's process group; returns ``(parallel, this rank's device)``.

    One rank: ``SingleProcess`` and ``device`` unchanged (no process group). Several: CUDA
    ranks use ``cuda:<LOCAL_RANK>`` and NCCL, CPU ranks gloo; ``run.collective_timeout``
    bounds every collective, ``run.data_parallel`` picks DDP or FSDP2.
    """
    if not ranks.joined:
        return SingleProcess(), device
    import torch.distributed as dist

    if device.type == "cuda":
        device = torch.device("cuda", ranks.local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(
            backend,
            rank=ranks.rank,
            world_size=ranks.world_size,
            timeout=timedelta(seconds=float(run.collective_timeout)),
            device_id=device if backend == "nccl" else None,
        )
    return DataParallel(ranks, device, run.data_parallel, run.collective_timeout), device
