"""From a config to a running trainer: ``build_runtime`` and ``train_from_config``.

``build_runtime(config, *, resume=False, device=None, max_steps=None)`` returns
``(trainer, checkpoint_manager)`` after, in order: validation → run-target override (moves an
implicit scheduler horizon too) → ``model.init_from`` (fills the model section and the
tokenizer from a transformers checkpoint, in place: ``speedtronic.model.hf_import``) → seeding
→ one run per checkpoint folder (``CheckpointManager.claim``: a folder holding another run's
checkpoints needs ``resume`` or ``checkpoint.overwrite``, else ``ConfigError``; with
``overwrite`` they are deleted when training starts, ``Trainer.fit``) → torch threads
(``runtime.threads``, ``speedtronic.train.threads``) → device (``run.device``) → precision →
model (the checkpoint's weights loaded, then moved to the device) → logger → data loader (its
stream seeded per node, so DiLoCo nodes see different batches; ``eval.holdout`` kept out) →
held-out eval set (``build_heldout``) → DumbDiLoCo coordinator (when ``distributed.enabled``;
it touches the exchange, after the data was found) → shape validation → optimizer → scheduler
→ ``Trainer`` → resume. Every configuration problem (a CUDA request without CUDA, a bad data
path, an unknown model) raises ``ConfigError`` naming the field, before any training step and
before anything is deleted.

Embedding the trainer in another process (what ``speedtronic run`` does)::

    from speedtronic.train.runtime import build_runtime

    trainer, manager = build_runtime(config, resume=True)
    trainer.logger.hooks.append(sink)          # on_event(event, payload) or a callable;
                                               # set sink.wants_all_steps = True for every step
    signal.signal(signal.SIGTERM, lambda *_: trainer.request_stop("SIGTERM"))  # or use
                                               # speedtronic.entrypoint.install_stop_handlers
    trainer.last_heartbeat                     # time.monotonic() of the last applied update
    result = trainer.fit()                     # TrainResult; result.stopped_reason after a stop

``request_stop`` is safe from signal handlers and other threads: the loop finishes the current
update, stops the coordinator, writes a final checkpoint and returns normally.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from speedtronic.checkpoint import CheckpointManager
from speedtronic.config import SpeedtronicConfig
from speedtronic.json_types import JSONView
from speedtronic.metrics.logger import MetricLogger, TextLog
from speedtronic.optim import build_optimizer, build_scheduler
from speedtronic.train.parallel import start_parallel
from speedtronic.train.precision import resolve_device, resolve_precision
from speedtronic.train.ranks import RankEnv
from speedtronic.train.result import TrainResult
from speedtronic.train.state import portable_config
from speedtronic.train.threads import ThreadBudget
from speedtronic.train.trainer import Trainer, TrainerOptions

if TYPE_CHECKING:
    from speedtronic.data.loader import ResumableDataLoader
    from speedtronic.train.evaluate import EvalResult, HeldOut
    from speedtronic.train.precision import PrecisionPlan
    from speedtronic.train.result import SyncCoordinator

#: What ``build_runtime`` accepts: a config, a mapping for ``from_dict``, or a file path.
ConfigSource = SpeedtronicConfig | JSONView | str | os.PathLike[str]

__all__ = [
    "build_logger",
    "build_optimizer",
    "build_runtime",
    "build_scheduler",
    "run",
    "seed_everything",
    "train",
    "train_from_config",
]


def seed_everything(seed: int) -> None:
    """Seed Python ``random``, NumPy, torch (CPU) and every CUDA device with ``seed``.

    Also sets ``PYTHONHASHSEED`` (affects child processes only).
    """
    random.seed(seed)
    os.environ["PYTHONHASHSEED"] = str(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except Exception:  # NumPy is optional
        pass
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def build_logger(config: SpeedtronicConfig, *, main: bool = True) -> MetricLogger:
    """The run's ``MetricLogger`` from ``config.logging`` (the Hub token is always redacted).

    Relative log paths are under ``run.output_dir`` (``config.text_log_path``/``events_path``).
    ``main=False`` (ranks other than 0 of a node): errors on stdout only, no files.
    """
    section = config.logging
    if not main:
        return MetricLogger(
            level="ERROR", format=section.format, secrets=[config.distributed.token]
        )
    return MetricLogger(
        level=section.level,
        file=config.text_log_path,
        json_file=config.events_path,
        every_steps=section.every_steps,
        format=section.format,
        secrets=[config.distributed.token],
    )


def _as_config(config: ConfigSource) -> SpeedtronicConfig:
    if isinstance(config, Mapping):
        return SpeedtronicConfig.from_dict(config).validate()
    if isinstance(config, (str, os.PathLike)):
        return SpeedtronicConfig.load(os.fspath(config)).validate()
    return config.validate()


def _device(config: SpeedtronicConfig, override: str | torch.device | None) -> torch.device:
    from speedtronic.config import ConfigError

    requested = override or config.run.device
    try:
        return resolve_device(requested)
    except RuntimeError as exc:
        raise ConfigError(
            f"run.device: {exc} on this machine (requested {requested!r}); use device: auto or cpu"
        ) from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"run.device: invalid device {requested!r}: {exc}") from None


def _precision(config: SpeedtronicConfig, device: torch.device) -> PrecisionPlan:
    from speedtronic.config import ConfigError

    try:
        return resolve_precision(config.precision, device)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _coordinator(
    config: SpeedtronicConfig,
    model: torch.nn.Module,
    logger: MetricLogger,
    *,
    heldout: HeldOut | None,
    device: torch.device,
    precision: PrecisionPlan,
) -> SyncCoordinator | None:
    """The DumbDiLoCo coordinator (None when ``distributed.enabled`` is false).

    A master scores every new global on the held-out set with its own copy of the model
    (on its aggregation thread) and writes the final global under ``<output_dir>/final``.
    """
    if not config.distributed.enabled:
        return None
    from speedtronic.diloco import DumbDiLoCoCoordinator

    evaluate_global = None
    if heldout is not None and config.distributed.role == "master":
        from speedtronic.model import build_model
        from speedtronic.train.evaluate import evaluate

        scorer = build_model(config.model).to(device)

        def evaluate_global(state: dict[str, torch.Tensor]) -> EvalResult:
            scorer.load_state_dict(state)
            return evaluate(scorer, heldout, device=device, precision=precision)

    return DumbDiLoCoCoordinator(
        config.distributed,
        model,
        state_dir=str(config.state_dir),
        logger=logger,
        evaluate=evaluate_global,
        final_dir=config.output_path / "final",
        run_config=portable_config(config),  # final/config.yaml: absolute data paths
        resumable=config.checkpoint.enabled,  # a stop saves a checkpoint to resume from
    )


def _check_parallel(config: SpeedtronicConfig, ranks: RankEnv) -> None:
    """Refuse combinations a data-parallel node does not support (before any work)."""
    from speedtronic.config import ConfigError

    if not ranks.joined:
        return
    if config.distributed.enabled and config.distributed.role == "master":
        raise ConfigError(
            "run.nproc_per_node: a DiLoCo master aggregates on one process; run it with "
            "nproc_per_node: 1 (or without torchrun)"
        )
    if config.run.data_parallel == "fsdp" and config.optimizer.name != "adamw":
        raise ConfigError(
            f"run.data_parallel: fsdp needs optimizer.name: adamw (got "
            f"{config.optimizer.name!r}: Muon's orthogonalisation needs whole matrices)"
        )
    if config.ooo_backprop:
        raise ConfigError("ooo_backprop is not supported with several ranks per node")


def _log_data(logger: TextLog, loader: ResumableDataLoader, heldout: HeldOut | None) -> None:
    """One line on the training source's loss floor (Markov data) and the held-out set."""
    from speedtronic.data.markov import MarkovTokenDataset

    dataset = loader.dataset
    if isinstance(dataset, MarkovTokenDataset):
        logger.info(
            "data: synthetic Markov chain, loss floor %.4f nats (uniform guess %.4f)",
            dataset.floor,
            math.log(dataset.vocab_size),
        )
    if heldout is not None:
        logger.info("eval: %d held-out tokens from %s", heldout.tokens, heldout.description)
        if heldout.tokens < heldout.requested:
            logger.warning(
                "eval.tokens asks for %d tokens but the held-out data holds %d; scoring all of it",
                heldout.requested,
                heldout.tokens,
            )


def build_runtime(
    config: ConfigSource,
    *,
    resume: bool = False,
    device: str | torch.device | None = None,
    max_steps: int | None = None,
    node_id: str | None = None,
    log_config: bool = True,
    ranks: RankEnv | None = None,
) -> tuple[Trainer, CheckpointManager]:
    """Build model, data, optimizer, schedule, logger, checkpoints and coordinator; see above.

    ``config`` is a ``SpeedtronicConfig``, a plain dict, or a config file path. ``max_steps``
    overrides the absolute step target on a copy of the config (the caller's object is not
    changed) and moves the scheduler horizon when ``scheduler.max_steps`` was not explicit.
    ``node_id`` selects the training stream of that DiLoCo node (default: the coordinator's
    node id; none without DiLoCo), e.g. to reproduce a node in one process. ``log_config``
    writes the redacted config to the logger; ``speedtronic train|run`` pass False because
    their startup record already holds it. ``ranks`` (torchrun's environment,
    ``RankEnv.from_environ``) makes this process one rank of a data-parallel node: it joins
    the process group (``speedtronic.train.parallel``), reads its shard of the node's data,
    and only rank 0 builds the coordinator, evaluates (DDP) and writes logs and checkpoints.
    """
    from speedtronic.config import ConfigError
    from speedtronic.data import build_node_dataloader
    from speedtronic.model import build_model
    from speedtronic.model.hf_import import load_hf_weights, resolve_init_from
    from speedtronic.model.sizes import check_memory
    from speedtronic.model.transformer import ReferenceTransformer
    from speedtronic.train.evaluate import build_heldout
    from speedtronic.train.shapes import validate_startup_shapes

    config = _as_config(config)
    if max_steps is not None:
        config = config.with_max_steps(max_steps)
    init = resolve_init_from(config)  # model.init_from: its shape and tokenizer, in place
    seed_everything(int(config.run.seed))
    ranks = ranks or RankEnv()
    section = config.checkpoint
    resume = bool(resume or section.resume)
    manager = CheckpointManager(
        config.checkpoint_dir,
        every_steps=section.every_steps,
        keep_last=section.keep_last,
        enabled=section.enabled,
        save_final=section.save_final,
    )
    # one run per folder, decided before anything (the exchange included) is touched; a run
    # that writes no checkpoint (checkpoint.enabled: false) starts no series to mix. With
    # overwrite, the old run's files go when this one starts training (manager.start)
    if section.enabled:
        manager.claim(resume=resume, overwrite=section.overwrite, clear=ranks.is_main)
    _check_parallel(config, ranks)
    threads = ThreadBudget.start(config.runtime.threads, os.environ)  # before the model
    parallel, resolved = start_parallel(ranks, _device(config, device), config.run)
    precision = _precision(config, resolved)
    origin = f"model.init_from {init.spec}" if init is not None else "the config"
    check_memory(config.model, origin)  # sizes are checked before they are built
    model = build_model(config.model)
    if init is not None and init.loads_weights:  # a DiLoCo worker starts from global 0
        if not isinstance(model, ReferenceTransformer):  # model.name was checked; a factory
            raise ConfigError(  # registered over it may build something else
                f"model.init_from loads into the reference transformer; model.name "
                f"{config.model.name!r} builds a {type(model).__name__}"
            )
        load_hf_weights(model, init)
    model.to(resolved)
    logger = build_logger(config, main=parallel.is_main)
    manager.warn = logger.warning
    if init is not None:
        logger.info(init.describe())
    logger.hooks.append(threads)  # keeps the count fitting as sibling processes come and go
    if node_id is None and config.distributed.enabled:  # the coordinator's, as it will say
        from speedtronic.diloco.link import resolve_node_id

        node_id = resolve_node_id(config.distributed.node_id, os.environ)
    # the data first: a bad path is refused before the coordinator touches the exchange
    loader = build_node_dataloader(
        config,
        node_id,
        pin_memory_device=resolved.type == "cuda",
        rank=parallel.rank,
        world_size=parallel.world_size,
    )
    heldout = build_heldout(config) if parallel.evaluates else None
    coordinator = None
    if config.distributed.enabled:  # FSDP: rank 0's round works on a full copy (every rank)
        round_model = parallel.round_model(model, lambda: build_model(config.model))
        if parallel.is_main:  # only rank 0 talks to the DiLoCo exchange
            coordinator = _coordinator(
                config, round_model, logger, heldout=heldout, device=resolved, precision=precision
            )
    if log_config:
        logger.info(
            "config %s",
            json.dumps(config.to_dict(redact_secrets=True), default=str, sort_keys=False),
        )
    _log_data(logger, loader, heldout)
    report = validate_startup_shapes(config, model, resolved, precision, logger=logger)
    parallel.wrap(model)  # before the optimizer: FSDP2 replaces the parameters
    optimizer = build_optimizer(model, config, resolved)
    scheduler = build_scheduler(optimizer, config)
    trainer = Trainer(
        model,
        optimizer,
        loader,
        device=resolved,
        config=config,
        scheduler=scheduler,
        logger=logger,
        checkpoint_manager=manager,
        coordinator=coordinator,
        options=TrainerOptions(
            heldout=heldout,
            parallel=parallel,
            max_steps=config.effective_max_steps,
            precision=precision,
            shape_report=report,
        ),
    )
    if resume:
        state = manager.load_latest(use=trainer.resume)  # newest usable; skips are warned
        if state is None:
            logger.warning("resume requested but no local checkpoint was found")
        else:
            logger.info("resumed from %s at step %d", state.get("path"), trainer.step)
    return trainer, manager


def train_from_config(
    config: ConfigSource,
    *,
    resume: bool = False,
    device: str | torch.device | None = None,
    max_steps: int | None = None,
) -> TrainResult:
    """``build_runtime(...)`` then ``trainer.fit()``; closes the logger's files afterwards."""
    trainer, _ = build_runtime(config, resume=resume, device=device, max_steps=max_steps)
    try:
        return trainer.fit()
    finally:
        trainer.logger.close()


run = train_from_config
train = train_from_config
