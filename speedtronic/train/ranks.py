"""How many ranks a node runs and how they start (``run.nproc_per_node``).

A node is one process per rank. ``speedtronic train|run`` with ``run.nproc_per_node`` above 1
becomes torchrun's elastic agent (``torch.distributed.launcher.elastic_launch``, the engine
behind ``torchrun --standalone``): it starts that many copies of the same command, each with
torchrun's rank environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``), watches them, and stops every rank when one dies. A process that finds that
environment (started by this agent, or by a user's own ``torchrun -m speedtronic run``) joins
the launch instead of starting one (:class:`RankEnv`).

The agent never builds a model and never binds the metrics port: rank 0 does both. A stop
signal sent to the agent is forwarded to every rank, which stop together at one step
(:mod:`speedtronic.train.parallel`); rank 0 writes the final checkpoint.
"""

from __future__ import annotations

import logging
import sys
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from speedtronic.config import SpeedtronicConfig

__all__ = [
    "RankEnv",
    "RanksOutcome",
    "launch_ranks",
    "resolve_nproc",
    "run_agent",
    "visible_gpus",
]

_LOG = logging.getLogger("speedtronic.ranks")


@dataclass(frozen=True)
class RankEnv:
    """This process's place in a torchrun launch (``world_size == 1``: not launched)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> RankEnv:
        """Read torchrun's ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` (absent: one process)."""
        try:
            world = int(environ.get("WORLD_SIZE", "1") or 1)
            rank = int(environ.get("RANK", "0") or 0)
            local = int(environ.get("LOCAL_RANK", str(rank)) or 0)
        except ValueError as exc:
            raise RuntimeError(f"invalid torchrun rank environment: {exc}") from None
        if world < 1 or not 0 <= rank < world:
            raise RuntimeError(f"invalid torchrun rank environment: RANK={rank} WORLD_SIZE={world}")
        return cls(rank=rank, world_size=world, local_rank=local)

    @property
    def joined(self) -> bool:
        """Whether this process is one rank of several."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the rank that logs, serves metrics, checkpoints and talks to DiLoCo."""
        return self.rank == 0


def visible_gpus() -> int:
    """CUDA devices this process can see (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_nproc(config: SpeedtronicConfig, gpus: int | None = None) -> int:
    """Ranks this node runs for a ``SpeedtronicConfig``.

    ``run.nproc_per_node: auto`` is the number of visible GPUs (``gpus``, default
    :func:`visible_gpus`), and 1 on CPU (``run.device: cpu`` or no GPU). A DiLoCo master
    aggregates and does not train on several ranks: always 1.
    """
    value = config.run.nproc_per_node
    if value == 1 or (config.distributed.enabled and config.distributed.role == "master"):
        return 1
    if value != "auto":
        return int(value)
    if str(config.run.device).startswith(("cpu", "mps")):
        return 1
    return max(1, visible_gpus() if gpus is None else int(gpus))


@dataclass
class RanksOutcome:
    """How the ranks of one launch ended: the agent's exit code and a one-line reason."""

    exit_code: int
    message: str


def _failure_message(exc: ChildFailedError, nproc: int) -> str:
    """One line naming the first rank that failed and how."""
    failures = exc.failures or {}
    parts = []
    for rank, failure in sorted(failures.items()):
        code = failure.exitcode
        how = f"was killed by {failure.signal_name()}" if code < 0 else f"exited with code {code}"
        parts.append(f"rank {rank} (pid {failure.pid}) {how}")
    first = "; ".join(parts[:3]) or str(exc).splitlines()[0]
    return f"{first}; the agent stopped all {nproc} ranks of this node"


def launch_ranks(
    nproc: int,
    argv: Sequence[str],
    *,
    node_id: str | None = None,
    shutdown_timeout: float = 30.0,
    monitor_interval: float = 0.2,
) -> RanksOutcome:
    """Run ``python -m speedtronic <argv>`` as ``nproc`` ranks under torchrun's elastic agent.

    ``node_id`` (claimed by the agent) is passed to every rank with ``--set``.
    ``shutdown_timeout`` (seconds) is how long the agent waits for ranks to stop after a
    signal or after one rank died, before it kills them. Returns exit code 0 when every rank
    succeeded or a stop signal was forwarded to them (they stop together; rank 0 saves), 1
    with the failed rank named when a rank failed. No restarts: the orchestrator (compose,
    Kubernetes) restarts the node, which resumes from rank 0's checkpoint.
    """
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    args = ["-m", "speedtronic", *argv]
    if node_id:
        args += ["--set", f"distributed.node_id={node_id}"]
    launch = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=int(nproc),
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # torchrun --standalone: a free local port
        max_restarts=0,
        monitor_interval=monitor_interval,
        start_method="spawn",
        signals_to_handle="SIGTERM,SIGINT",
        shutdown_timeout=max(1, int(shutdown_timeout)),
    )
    try:
        elastic_launch(launch, sys.executable)(*args)
    except ChildFailedError as exc:
        return RanksOutcome(1, _failure_message(exc, nproc))
    except SignalException as exc:
        name = exc.sigval.name
        return RanksOutcome(
            0, f"{name} forwarded to all {nproc} ranks: they stop at one step, rank 0 saves"
        )
    return RanksOutcome(0, f"all {nproc} ranks finished")


def run_agent(config: SpeedtronicConfig, nproc: int, argv: Sequence[str] | None) -> int:
    """``speedtronic train|run`` as the agent of ``nproc`` ranks: log, :func:`launch_ranks`
    with the node id and ``run.collective_timeout``, log the outcome; returns exit code 0.

    Raises ``ConfigError`` when there is no command line to run (``argv`` None: an embedding
    caller), ``RuntimeError`` naming the rank when one failed (exit 1 in the CLI).
    """
    if argv is None:
        from speedtronic.config import ConfigError

        raise ConfigError(
            f"run.nproc_per_node resolves to {nproc} ranks, which only the speedtronic "
            "train|run command line starts (or launch with torchrun -m speedtronic run)"
        )
    run = config.run
    _LOG.info(
        "starting %d ranks (run.data_parallel=%s, run.collective_timeout=%g s)",
        nproc,
        run.data_parallel,
        run.collective_timeout,
    )
    distributed = config.distributed
    node_id = distributed.node_id if distributed.enabled else None
    outcome = launch_ranks(nproc, argv, node_id=node_id, shutdown_timeout=run.collective_timeout)
    if outcome.exit_code:
        _LOG.error("ranks failed: %s", outcome.message)
        raise RuntimeError(outcome.message)
    _LOG.info("ranks finished: %s", outcome.message)
    return outcome.exit_code
