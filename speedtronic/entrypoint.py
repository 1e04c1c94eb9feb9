"""`speedtronic train` and `speedtronic run`: one runner around one training run.

The CLI resolves the layered config (file < secret files < environment < flags, see
`speedtronic.config.resolve_config`) and calls `launch`, which, in order:

1. configures process logging (``logging.format: text|json``; JSON is one object per line,
   `speedtronic.metrics.logger.JsonLogFormatter`);
2. resolves the node identity: a worker without a node id claims a worker slot in
   ``distributed.slots_dir`` (`speedtronic.slots`), and ``{node_id}`` in the output
   paths (``run.output_dir``, ``logging.json_file``, ``logging.file``,
   ``distributed.cache_dir``) becomes the node id, so a recreated container finds its
   checkpoints;
3. locks ``run.output_dir`` for this process (`speedtronic.folder_lock`): a second process on
   the folder exits 2 at once naming the holder;
4. logs the startup record once: the redacted config, where each non-default value came
   from, and the versions of speedtronic, torch, CUDA and Python;
5. binds the metrics/health server (``metrics.host:metrics.port``; ``metrics.enabled`` unset
   means on under ``run`` and off under ``train``) — a port already in use is a configuration
   error before any training starts; the server bounds its clients (connections, request
   time and size, GET/HEAD only: `speedtronic.metrics.server`);
6. arms a stall watchdog (under ``run``, and under ``train`` when the server runs): once the
   training loop runs, a heartbeat older than ``metrics.stall_seconds`` (what ``/healthz``
   reports as 503) ends the process with exit code 1, so ``restart: on-failure`` and
   Kubernetes restart it;
7. installs the SIGTERM/SIGINT handlers (`install_stop_handlers`) that ask the trainer to stop
   at the next step boundary; a second signal while stopping raises ``KeyboardInterrupt``;
8. builds the runtime (model, data, optimizer, coordinator), attaches the Prometheus sink and,
   on a terminal under ``train``, a progress bar; marks the process ready (for a worker: once
   the coordinator knows the first global state); only then, every check at start passed,
   writes the resolved config into the folder (a refused run leaves the folder as it was; a
   run over another's checkpoints with ``--overwrite`` deletes them when it starts training);
9. trains, and on a graceful stop lets the trainer write the final checkpoint and stop the
   coordinator (which flushes or persists a pending delta upload); releases the worker slot
   and the folder.

Several ranks per node (``run.nproc_per_node`` above 1, `speedtronic.train.ranks`): this
process claims the node's identity, then becomes torchrun's elastic agent and starts the same
command once per rank instead of training; it returns the agent's outcome (a dead rank: exit 1,
naming it). A process started by torchrun (``RANK``/``WORLD_SIZE`` set) is one rank: rank 0
does all of the above, the other ranks train quietly (errors only, no server, no watchdog,
no files) and follow rank 0 (`speedtronic.train.parallel`).

Rules are raised where they are found: a node id that another live node already uses is a
`NodeIdCollisionError` from the coordinator's claim at startup, under ``train`` and ``run``.

Exit codes (`RunOutcome.exit_code`, and the CLI's mapping of exceptions): 0 success or
graceful stop; 2 configuration error (`ConfigError`, including a port in use and a node-id
collision); 1 runtime failure or a stalled training loop; 128+signal (130/143) only when the
graceful stop itself failed.
"""

from __future__ import annotations

import errno
import logging
import os
import platform
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, TYPE_CHECKING, Literal

from speedtronic.config import ConfigError, ResolvedConfig
from speedtronic.diloco.link import ExchangeAccessError, NodeIdCollisionError
from speedtronic.json_types import JSON
from speedtronic.metrics.logger import JsonLogFormatter, RedactingFilter
from speedtronic.metrics.startup import devices_line, exchange_line, run_summary
from speedtronic.train.ranks import RankEnv, resolve_nproc, run_agent

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from speedtronic.checkpoint import CheckpointManager
    from speedtronic.config import LoggingConfig, SpeedtronicConfig
    from speedtronic.folder_lock import FolderLock
    from speedtronic.metrics.hooks import Hook
    from speedtronic.metrics.integrations import TensorboardHook, WandbHook
    from speedtronic.metrics.progress import ProgressBarHook
    from speedtronic.metrics.prometheus import PrometheusSink
    from speedtronic.metrics.server import MetricsServer, StallWatchdog
    from speedtronic.slots import SlotClaim
    from speedtronic.train.result import TrainResult
    from speedtronic.train.trainer import Trainer

__all__ = [
    "JsonLogFormatter",
    "NodeIdCollisionError",
    "RunOutcome",
    "install_stop_handlers",
    "launch",
    "run_command",
    "runtime_versions",
]

_LOG = logging.getLogger("speedtronic.entrypoint")
_TEXT_FORMAT = "%(asctime)s | %(levelname)s | %(name)s | %(message)s"
_SIGNALS = (signal.SIGTERM, signal.SIGINT)
EXIT_STALLED = 1
#: Output paths that may contain ``{node_id}`` (section, field).
NODE_PATHS = (
    ("run", "output_dir"),
    ("logging", "json_file"),
    ("logging", "file"),
    ("distributed", "cache_dir"),
)


def _event(name: str, **fields: object) -> JSON:
    """``extra=`` for a log record that is also a structured event."""
    return {"st_event": name, "st_fields": fields}


def runtime_versions() -> JSON:
    """Versions recorded in the startup log: speedtronic, torch, CUDA, Python, host."""
    import torch

    import speedtronic

    cuda = torch.version.cuda
    return {
        "speedtronic": speedtronic.__version__,
        "torch": torch.__version__,
        "cuda": cuda,
        "cuda_available": bool(cuda) and torch.cuda.is_available(),
        "python": platform.python_version(),
        "hostname": socket.gethostname(),
    }


Command = Literal["train", "run"]


@dataclass
class RunOutcome:
    """What one `launch` ended with: the process exit code and, when training returned, its
    `TrainResult` (``stopped_reason`` set after a graceful stop; rank 0's alone on a node of
    several ranks, so only it reports)."""

    exit_code: int
    result: TrainResult | None = None


@dataclass
class _RunState:
    """What the signal handlers, probes and the watchdog share during one run."""

    trainer: Trainer | None = None
    sink: PrometheusSink | None = None
    built: bool = False
    stop_signal: int | None = None
    training_started: bool = False
    training_done: bool = False
    last_phase: float = field(default_factory=time.monotonic)

    def heartbeat(self) -> float | None:
        """Latest of: start-up phase change, trainer heartbeat, last train_step seen."""
        candidates = [self.last_phase]
        beat = self.trainer.last_heartbeat if self.trainer is not None else None
        if isinstance(beat, (int, float)):
            candidates.append(float(beat))
        step_time = self.sink.last_step_time if self.sink is not None else None
        if step_time is not None:
            candidates.append(step_time)
        return max(candidates)

    def ready(self) -> bool:
        """Config loaded and model built; a worker also needs the first global state."""
        if not self.built or self.trainer is None:
            return False
        coordinator = self.trainer.coordinator
        return coordinator is None or bool(coordinator.is_ready())

    def watching(self) -> bool:
        """Whether a stall counts: the loop runs and no graceful stop is in progress."""
        return self.training_started and not self.training_done and self.stop_signal is None

    def stopping(self) -> bool:
        """Whether a stop signal already arrived."""
        return self.stop_signal is not None

    def on_signal(self, name: str) -> None:
        """A stop signal arrived: remember it, log it, forward it to the trainer."""
        self.stop_signal = int(signal.Signals[name])
        _LOG.info(
            "%s received: stopping at the next step boundary",
            name,
            extra=_event("stop_requested", signal=name),
        )
        if self.trainer is not None:
            self.trainer.request_stop(name)

    def on_event(self, event: str, payload: JSON) -> None:
        """Logger hook: the loop has started (the watchdog counts from here)."""
        if event == "train_start":
            self.training_started = True


def install_stop_handlers(
    request_stop: Callable[[str], None],
    is_stopping: Callable[[], bool] = lambda: False,
    signals: Iterable[signal.Signals] = _SIGNALS,
) -> Callable[[], None]:
    """Route ``signals`` to ``request_stop(<signal name>)``; a signal that arrives while
    ``is_stopping()`` raises ``KeyboardInterrupt`` instead (exit 130 in the CLI). Returns a
    function that restores the previous handlers; a no-op outside the main thread (Python
    only delivers signals there)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous: dict[signal.Signals, Callable[[int, FrameType | None], object] | int | None] = {}

    def handler(signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if is_stopping():
            raise KeyboardInterrupt(f"second {name} while stopping")
        request_stop(name)

    for sig in signals:
        previous[sig] = signal.signal(sig, handler)

    def restore() -> None:
        for sig, old in previous.items():
            signal.signal(sig, old)

    return restore


def _configure_logging(
    logging_config: LoggingConfig, *, main: bool = True, secrets: tuple[str | None, ...] = ()
) -> logging.Handler:
    """Attach one stdout handler (text or JSON) to the ``speedtronic`` logger tree (errors
    only on ranks other than 0). Every line through it has ``secrets`` scrubbed, whichever
    module logged it and whenever (a thread that outlives its component included)."""
    handler = logging.StreamHandler(sys.stdout)
    handler.addFilter(RedactingFilter([s for s in secrets if s]))
    if logging_config.format == "json":
        handler.setFormatter(JsonLogFormatter())
    else:
        handler.setFormatter(logging.Formatter(_TEXT_FORMAT))
    root = logging.getLogger("speedtronic")
    root.addHandler(handler)
    root.setLevel(logging_config.level if main else logging.ERROR)
    return handler


RESOLVED_CONFIG_FILE = "resolved_config.yaml"


def _write_resolved(config: SpeedtronicConfig, sources: dict[str, str]) -> Path | None:
    """The full resolved config (redacted) and its sources, as YAML in ``run.output_dir``;
    the path, or None when it cannot be written (logged, never fatal)."""
    import yaml

    from speedtronic.config.redaction import scrub

    path = config.output_path / RESOLVED_CONFIG_FILE
    token = config.distributed.token
    text = yaml.safe_dump(
        {"config": config.to_dict(redact_secrets=True), "sources": sources}, sort_keys=False
    )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(scrub(text, [token] if token else []), encoding="utf-8")
    except OSError as exc:
        _LOG.warning("cannot write the resolved config to %s: %s", path, exc)
        return None
    return path


def _config_origin(config_path: str | None) -> str:
    """Which config the run started from: a file, the embedded main job, or none."""
    from speedtronic.defaults import MAIN_JOB

    if config_path is None:
        return "no config file"
    if Path(config_path).resolve() == MAIN_JOB:
        return f"the embedded main job {config_path}"
    return config_path


def _log_startup(
    command: Command,
    config: SpeedtronicConfig,
    sources: dict[str, str],
    config_path: str | None = None,
) -> None:
    """The startup record: versions, the config file the run started from (``config_path``),
    and where the resolved (redacted) config and its sources go (`_write_resolved` writes them
    once the runtime is built); under ``logging.format: json`` the event carries them too."""
    started_from = _config_origin(config_path)
    redacted = config.to_dict(redact_secrets=True)
    versions = runtime_versions()
    path = config.output_path / RESOLVED_CONFIG_FILE
    if config.logging.format == "json":
        _LOG.info(
            "speedtronic %s starting",
            command,
            extra=_event(
                "startup",
                versions=versions,
                config=redacted,
                sources=sources,
                config_source=started_from,
                config_file=str(path),
            ),
        )
        return
    cuda = versions["cuda"] or "none"
    if versions["cuda"] and not versions["cuda_available"]:
        cuda += " (no GPU available)"
    _LOG.info(
        "speedtronic %s starting: speedtronic %s, torch %s, CUDA %s, python %s",
        command,
        versions["speedtronic"],
        versions["torch"],
        cuda,
        versions["python"],
    )
    origins: dict[str, int] = {}
    for origin in sources.values():
        kind = origin.split(":", 1)[0]
        origins[kind] = origins.get(kind, 0) + 1
    counted = ", ".join(f"{count} {kind}" for kind, count in origins.items()) or "defaults only"
    _LOG.info(
        "config: %s (resolved, redacted, written once the runtime is built; from %s; values "
        "set: %s)",
        path,
        started_from,
        counted,
    )


def _check_local_host(host: str) -> None:
    """``metrics.host`` must name an address of this machine: one that does not (or a name
    that does not resolve) is a ``ConfigError`` naming ``metrics.host``, not the port."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), 0, type=socket.SOCK_STREAM)
        family, kind, proto, _name, address = infos[0]
        with socket.socket(family, kind, proto) as probe:
            probe.bind(address[:2] if family == socket.AF_INET else address)
    except socket.gaierror as exc:
        raise ConfigError(f"metrics.host: cannot resolve {host} ({exc.strerror})") from None
    except OSError as exc:
        if exc.errno == errno.EADDRNOTAVAIL:
            raise ConfigError(
                f"metrics.host: {host} is not an address of this machine ({exc.strerror}); "
                "use 0.0.0.0 (every interface) or one of this machine's addresses"
            ) from None


def _start_server(
    command: Command, config: SpeedtronicConfig, registry: CollectorRegistry, state: _RunState
) -> MetricsServer | None:
    """Bind and start the metrics server; None when it is off (``metrics.enabled: false``,
    or unset under ``train``)."""
    metrics = config.metrics
    enabled = (command == "run") if metrics.enabled is None else metrics.enabled
    if not enabled:
        if metrics.enabled is False:
            _LOG.info("metrics server off (metrics.enabled: false)")
        else:
            _LOG.info("metrics server off (metrics.enabled: true serves /metrics in %s)", command)
        return None
    from speedtronic.metrics.server import MetricsServer

    _check_local_host(metrics.host)
    server = MetricsServer(
        metrics.host,
        metrics.port,
        registry,
        heartbeat=state.heartbeat,
        ready=state.ready,
        stall_seconds=metrics.stall_seconds,
    ).start()
    limits = server.limits
    _LOG.info(
        "serving /metrics /healthz /readyz on %s:%d (at most %d connections, %g s per request)",
        metrics.host,
        server.port,
        limits["max_connections"],
        limits["request_timeout_seconds"],
        extra=_event("metrics_server", host=metrics.host, port=server.port, **limits),
    )
    return server


def _claim_identity(
    config: SpeedtronicConfig, sources: dict[str, str], ranks: RankEnv | None = None
) -> SlotClaim | None:
    """Give a worker without a node id a slot (when ``distributed.slots_dir`` is set) and
    put the node id into the ``{node_id}`` output paths; the `SlotClaim`, or None. ``ranks``:
    this process's place in a torchrun launch (default: one process)."""
    ranks = ranks or RankEnv()
    distributed = config.distributed
    claim = None
    if (
        distributed.enabled
        and distributed.role == "worker"
        and distributed.slots_dir
        and distributed.node_id is None
    ):
        if ranks.joined:
            raise ConfigError(
                "distributed.slots_dir: the ranks of a torchrun launch cannot each claim a "
                "slot; set distributed.node_id (SPEEDTRONIC_NODE_ID), or let speedtronic start "
                "the ranks (run.nproc_per_node) so it claims one slot for the node"
            )
        from speedtronic.slots import claim_slot

        try:
            claim = claim_slot(distributed.slots_dir)
        except OSError as exc:
            raise ConfigError(
                f"distributed.slots_dir: cannot claim a worker slot in "
                f"{distributed.slots_dir!r}: {exc.strerror or exc}"
            ) from None
        distributed.node_id = claim.node_id
        sources["distributed.node_id"] = f"slot:{distributed.slots_dir}"
        _LOG.info(
            "worker slot %s claimed in %s",
            claim.node_id,
            distributed.slots_dir,
            extra=_event("worker_slot", **asdict(claim.lease)),
        )
    try:
        _expand_node_paths(config)
    except ConfigError:
        if claim is not None:
            claim.release()
        raise
    return claim


def _lock_folder(config: SpeedtronicConfig, command: Command, ranks: RankEnv) -> FolderLock | None:
    """This process's lock on ``run.output_dir`` (`speedtronic.folder_lock`); None on ranks
    other than 0 (they write nothing) and on rank 0 of a launch whose agent, its parent,
    holds the folder for the node."""
    from speedtronic.folder_lock import FolderInUseError, FolderLock

    if not ranks.is_main:
        return None
    try:
        return FolderLock.acquire(config.output_path, command=f"speedtronic {command}")
    except FolderInUseError as exc:
        if ranks.joined and exc.pid == os.getppid():
            return None
        raise


def _expand_node_paths(config: SpeedtronicConfig) -> None:
    """Replace ``{node_id}`` in the `NODE_PATHS` by ``distributed.node_id``."""
    node_id = config.distributed.node_id
    for section_name, name in NODE_PATHS:
        section = getattr(config, section_name)
        value = getattr(section, name)
        if not isinstance(value, str) or "{node_id}" not in value:
            continue
        if not node_id:
            raise ConfigError(
                f"{section_name}.{name}: {value!r} uses {{node_id}} but this process has no "
                "node id; set distributed.node_id (SPEEDTRONIC_NODE_ID) or, for a worker, "
                "distributed.slots_dir"
            )
        setattr(section, name, value.replace("{node_id}", node_id))


def _exit_stalled(code: int) -> None:
    """End the process at once (the training loop cannot be stopped gracefully)."""
    os._exit(code)


def _start_watchdog(config: SpeedtronicConfig, state: _RunState) -> StallWatchdog:
    """The stall watchdog (`speedtronic.metrics.server.StallWatchdog`), started."""
    from speedtronic.metrics.server import StallWatchdog

    stall_seconds = config.metrics.stall_seconds

    def on_stall(age: float) -> None:
        _LOG.error(
            "training loop stalled: no heartbeat for %.0f s (metrics.stall_seconds=%g); "
            "exiting with code %d so the orchestrator restarts the process",
            age,
            stall_seconds,
            EXIT_STALLED,
            extra=_event("stalled", heartbeat_age_seconds=round(age, 1), stall=stall_seconds),
        )
        for handler in logging.getLogger("speedtronic").handlers:
            handler.flush()
        _exit_stalled(EXIT_STALLED)

    return StallWatchdog(state.heartbeat, stall_seconds, on_stall, armed=state.watching).start()


def _identity(config: SpeedtronicConfig, trainer: Trainer) -> tuple[str, str]:
    """(role, node_id) labels: the coordinator's when distributed, else the host name."""
    distributed = config.distributed
    coordinator = trainer.coordinator
    role = distributed.role if distributed.enabled else "single"
    if coordinator is not None:
        return str(coordinator.role or role), str(coordinator.node_id)
    return role, str(distributed.node_id or socket.gethostname())


def _build(config: SpeedtronicConfig, resume: bool) -> tuple[Trainer, CheckpointManager]:
    """The runtime (trainer, checkpoint manager) of this rank; the config is already in the
    startup log."""
    from speedtronic.train.runtime import build_runtime

    ranks = RankEnv.from_environ(os.environ)
    return build_runtime(config, resume=resume, log_config=False, ranks=ranks)


def _trackers(config: SpeedtronicConfig, node_id: str) -> list[WandbHook | TensorboardHook]:
    """The experiment trackers of ``logging.trackers`` (W&B, TensorBoard; extra
    ``speedtronic[logging]``), each given the redacted config. Project: ``logging.project`` or
    ``run.name``; run name: ``logging.run_name`` or the node id. TensorBoard writes under
    ``<run.output_dir>/tensorboard/<run name>``; W&B honours ``WANDB_MODE=offline``. A
    project or run name that holds the token's value (a node id from ``HOSTNAME``, a config
    built without the layering's check) is a ``ConfigError`` that does not show it: it would
    become a directory or a W&B run name."""
    from speedtronic.config.redaction import holds_secret
    from speedtronic.metrics.integrations import TensorboardHook, WandbHook

    section = config.logging
    project = section.project or config.run.name
    name = section.run_name or node_id
    for what, value in (("project", project), ("run name", name)):
        if section.trackers and holds_secret(str(value), [config.distributed.token]):
            raise ConfigError(
                f"logging.trackers: the tracker {what} holds the value of distributed.token "
                "(not shown); set logging.project / logging.run_name to another name"
            )
    redacted = config.to_dict(redact_secrets=True)
    hooks: list[WandbHook | TensorboardHook] = []
    for tracker in section.trackers:
        try:
            if tracker == "wandb":
                hooks.append(WandbHook(project=project, name=name, config=redacted))
            else:
                hook = TensorboardHook(str(config.output_path / "tensorboard" / name))
                hook.writer.add_text("config", _yaml_block(redacted), global_step=0)
                hooks.append(hook)
        except RuntimeError as exc:  # the library is not installed
            raise ConfigError(f"logging.trackers: {tracker}: {exc}") from None
        _LOG.info("tracker %s: project %s, run %s", tracker, project, name)
    return hooks


def _yaml_block(values: JSON) -> str:
    import yaml

    return "```yaml\n" + yaml.safe_dump(values, sort_keys=False) + "```"


def _isatty(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def launch(
    resolved: ResolvedConfig,
    *,
    command: Command = "run",
    resume: bool = False,
    progress: bool | None = False,
    extra_hooks: Iterable[Hook] = (),
    argv: Sequence[str] | None = None,
) -> RunOutcome:
    """Run one training job as ``speedtronic <command>`` does (see the module docstring).

    Args:
        resolved: a `ResolvedConfig` (``.config`` and ``.sources``) from ``resolve_config``.
        command: ``"run"`` (the container entrypoint: metrics server on unless
            ``metrics.enabled: false``, stall watchdog) or ``"train"`` (server only when
            ``metrics.enabled: true``).
        resume: resume from the newest local checkpoint (also ``checkpoint.resume``).
        progress: show a progress bar on stderr; None: only when stdout and stderr are
            terminals.
        extra_hooks: appended to the trainer's logger hooks (``on_event`` objects or callables).
        argv: the command line after ``speedtronic``, which the agent runs once per rank when
            ``run.nproc_per_node`` is above 1.

    Returns:
        `RunOutcome`: exit code 0 on success or after a graceful SIGTERM/SIGINT stop (with the
        `TrainResult`), 128+signal when the graceful stop itself failed.

    Raises:
        ConfigError: configuration problems (exit 2 in the CLI): port in use, node-id
            collision, and whatever the runtime rejects before training.
        KeyboardInterrupt: a second signal while stopping (exit 130 in the CLI).
        Exception: runtime failures (exit 1 in the CLI).
    """
    config = resolved.config
    sources = dict(resolved.sources)
    ranks = RankEnv.from_environ(os.environ)  # torchrun's rank environment, if any
    handler = _configure_logging(
        config.logging, main=ranks.is_main, secrets=(config.distributed.token,)
    )
    state = _RunState()
    server = watchdog = slot = lock = None
    restore_signals: Callable[[], None] = lambda: None  # noqa: E731 - replaced below
    try:
        slot = _claim_identity(config, sources, ranks)
        lock = _lock_folder(config, command, ranks)  # before anything is written there
        nproc = 1 if ranks.joined else resolve_nproc(config)
        if nproc > 1:  # this process becomes torchrun's agent for the node's ranks
            return RunOutcome(run_agent(config, nproc, argv))
        if ranks.is_main:
            _log_startup(command, config, sources, resolved.config_path)
        from prometheus_client import CollectorRegistry

        registry = CollectorRegistry()
        if ranks.is_main:  # rank 0 serves the node's metrics and watches its loop
            server = _start_server(command, config, registry, state)
            if command == "run" or server is not None:
                watchdog = _start_watchdog(config, state)
        restore_signals = install_stop_handlers(state.on_signal, is_stopping=state.stopping)
        # the bar draws on stderr and replaces the step lines on stdout: both on a terminal
        show = _isatty(sys.stdout) and _isatty(sys.stderr) if progress is None else progress
        shown = show and ranks.is_main
        return _train(config, resume, state, registry, shown, extra_hooks, ranks, sources)
    finally:
        restore_signals()
        if watchdog is not None:
            watchdog.stop()
        if server is not None:
            server.stop()
        if lock is not None:
            lock.release()
        if slot is not None:
            slot.release()
        logging.getLogger("speedtronic").removeHandler(handler)


def run_command(resolved: ResolvedConfig, *, resume: bool = False) -> int:
    """``speedtronic run``: `launch` as the container entrypoint; returns the exit code."""
    return launch(resolved, command="run", resume=resume).exit_code


def _attach_progress(trainer: Trainer) -> ProgressBarHook:
    """A progress bar hook on the trainer's logger; per-step text lines go to the bar."""
    from speedtronic.metrics.progress import ProgressBarHook, TqdmStream

    bar = ProgressBarHook(trainer.step, max(trainer.step, trainer.max_steps))
    logger = trainer.logger
    logger.hooks.append(bar)
    if logger.file is None:  # the bar replaces per-step lines on the terminal only
        logger.text_steps = False
        logger.set_stream(TqdmStream())
    return bar


def _train(
    config: SpeedtronicConfig,
    resume: bool,
    state: _RunState,
    registry: CollectorRegistry,
    progress: bool,
    extra_hooks: Iterable[Hook],
    ranks: RankEnv,
    sources: dict[str, str],
) -> RunOutcome:
    trainer, _manager = _build(config, resume)
    parallel = trainer.parallel  # the node's ranks (SingleProcess: one process)
    state.trainer = trainer
    role, node_id = _identity(config, trainer)
    from speedtronic.metrics.prometheus import PrometheusSink
    from speedtronic.train.result import MembershipSource

    state.sink = PrometheusSink(role, node_id, registry=registry)
    # widened: mypy takes SyncCoordinator and MembershipSource for disjoint (statement unreachable)
    nodes: object = trainer.coordinator
    if isinstance(nodes, MembershipSource):  # a master's nodes, read at scrape time
        state.sink.watch_membership(nodes.membership)
    trackers = _trackers(config, node_id) if ranks.is_main else []
    trainer.logger.hooks.extend([state.sink, state, *trackers, *extra_hooks])
    bar = _attach_progress(trainer) if progress else None
    if ranks.is_main:  # every check at start passed: the first write into the folder
        _write_resolved(config, sources)
    state.built = True
    state.last_phase = time.monotonic()
    summary = run_summary(config, sum(p.numel() for p in trainer.model.parameters()))
    _LOG.info(
        "runtime built: %s",
        summary,
        extra=_event("runtime_built", role=role, node_id=node_id, summary=summary),
    )
    # where it computes; the CPU threads are said where set
    devices = devices_line(trainer.device, trainer.precision.mode, trainer.parallel.world_size)
    _LOG.info("devices: %s", devices, extra=_event("devices", devices=devices))
    if config.distributed.enabled:
        exchange = exchange_line(config, role, node_id)
        _LOG.info(
            "exchange: %s",
            exchange,
            extra=_event(
                "exchange",
                repo_id=config.distributed.repo_id,
                delta_dtype=config.distributed.delta_dtype,
                global_dtype=config.distributed.global_dtype,
            ),
        )
    try:
        if state.stop_signal is not None and parallel.stops_locally:
            _LOG.info("stop requested before training started; exiting without training")
            return RunOutcome(0)
        try:
            result = trainer.fit()
        except ExchangeAccessError as exc:  # exit 2: name where the token came from
            raise exc.with_token_source(sources.get("distributed.token")) from None
        except Exception as exc:
            if state.stop_signal is not None and not isinstance(exc, ConfigError):
                _LOG.exception("graceful stop failed")
                return RunOutcome(128 + state.stop_signal)
            raise
        finally:
            state.training_done = True
    finally:
        if bar is not None:
            bar.close()
        trainer.logger.close()
        for tracker in trackers:
            tracker.close()
    parallel.close()  # the ranks leave together (after a failure the agent ends them)
    reason = result.stopped_reason
    _LOG.info(
        "run finished after %s steps%s",
        result.steps,
        f" (stopped: {reason})" if reason else "",
        extra=_event("run_finished", steps=result.steps, stopped_reason=reason),
    )
    if config.run.push_to_hub and ranks.is_main and role != "worker" and not state.stop_signal:
        _push_final(config)
    return RunOutcome(0, result if ranks.is_main else None)


def _push_final(config: SpeedtronicConfig) -> None:
    """``run.push_to_hub``: the master (or a lone node) pushes its newest checkpoint, which
    holds the final global, as ``speedtronic push`` would; a failure leaves the run's files
    in place and says how to push them again."""
    from speedtronic.publish import push_model

    repo = config.run.push_to_hub
    assert repo is not None  # the caller checked
    try:
        pushed = push_model(config, repo_id=repo, log=_LOG.info)
    except Exception as exc:
        raise RuntimeError(
            f"training finished, but pushing to {repo} failed ({type(exc).__name__}: {exc}); "
            f"the checkpoints are kept: retry with speedtronic push --config <this config> "
            f"--repo {repo}"
        ) from None
    _LOG.info(
        "pushed the model (step %s) to the Hub repo %s in one commit",
        pushed.step,
        repo,
        extra=_event("model_pushed", repo=repo, step=pushed.step, files=len(pushed.files)),
    )
