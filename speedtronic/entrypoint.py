"""`speedtronic run`: the container entrypoint around one training run.

The CLI resolves the layered config (file < secret files < environment < flags, see
`speedtronic.config.resolve_config`) and calls `run_command`, which, in order:

1. configures process logging (``logging.format: text|json``; JSON is one object per line);
2. resolves the node identity: a worker without a node id claims a worker slot in
   ``distributed.slots_dir`` (`speedtronic.diloco.slots`), and ``{node_id}`` in the output
   paths (``run.output_dir``, ``logging.json_file``, ``logging.file``,
   ``distributed.cache_dir``) becomes the node id, so a recreated container finds its
   checkpoints;
3. logs the redacted config, where each non-default value came from, and the versions of
   speedtronic, torch, CUDA and Python;
4. binds the metrics/health server (``metrics.host:metrics.port``; on by default under ``run``)
   — a port already in use is a configuration error before any training starts; the server
   bounds its clients (connections, request time and size, GET/HEAD only:
   `speedtronic.metrics.server`);
5. arms a stall watchdog: once the training loop runs, a heartbeat older than
   ``metrics.stall_seconds`` (what ``/healthz`` reports as 503) ends the process with exit
   code 1, so ``restart: on-failure`` and Kubernetes restart it;
6. installs SIGTERM/SIGINT handlers that ask the trainer to stop at the next step boundary;
7. builds the runtime (model, data, optimizer, coordinator), attaches the Prometheus sink,
   marks the process ready (for a worker: once the coordinator knows the first global state);
8. trains, and on a graceful stop lets the trainer write the final checkpoint and stop the
   coordinator (which flushes or persists a pending delta upload); releases the worker slot.

Exit codes (the CLI maps exceptions): 0 success or graceful stop; 2 configuration error
(`ConfigError`, including a port in use and a node-id collision); 1 runtime failure or a
stalled training loop; 128+signal (130/143) only when the graceful stop itself failed.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

from speedtronic.config import ConfigError

__all__ = ["JsonLogFormatter", "NodeIdCollisionError", "run_command", "runtime_versions"]

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


class NodeIdCollisionError(ConfigError):
    """Another live node already uses this worker's node id (exit code 2)."""


class JsonLogFormatter(logging.Formatter):
    """One JSON object per record, the same shape as the MetricLogger's JSON lines:
    ``{"ts", "level", "logger", "message"}``, plus ``"event"`` and ``"fields"`` for records
    logged with ``extra={"st_event": ..., "st_fields": {...}}``."""

    def format(self, record: logging.LogRecord) -> str:
        """Render `record` as a single-line JSON object."""
        stamp = datetime.fromtimestamp(record.created, tz=timezone.utc)
        body: dict[str, Any] = {
            "ts": stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        event = getattr(record, "st_event", None)
        if event is not None:
            body["event"] = event
            body["fields"] = getattr(record, "st_fields", {})
        if record.exc_info:
            body["exception"] = self.formatException(record.exc_info)
        return json.dumps(body, default=str)


def _event(name: str, **fields: Any) -> dict[str, Any]:
    """``extra=`` for a log record that is also a structured event."""
    return {"st_event": name, "st_fields": fields}


def runtime_versions() -> dict[str, Any]:
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


@dataclass
class _RunState:
    """What the signal handlers, probes and the collision hook share during one run."""

    trainer: Any = None
    sink: Any = None
    built: bool = False
    stop_signal: int | None = None
    collision: str | None = None
    training_started: bool = False
    training_done: bool = False
    last_phase: float = field(default_factory=time.monotonic)

    def heartbeat(self) -> float | None:
        """Latest of: start-up phase change, trainer heartbeat, last train_step seen."""
        candidates = [self.last_phase]
        beat = getattr(self.trainer, "last_heartbeat", None)
        if isinstance(beat, (int, float)):
            candidates.append(float(beat))
        step_time = getattr(self.sink, "last_step_time", None)
        if step_time is not None:
            candidates.append(step_time)
        return max(candidates)

    def ready(self) -> bool:
        """Config loaded and model built; a worker also needs the first global state."""
        if not self.built or self.trainer is None:
            return False
        coordinator = getattr(self.trainer, "coordinator", None)
        is_ready = getattr(coordinator, "is_ready", None)
        return bool(is_ready()) if callable(is_ready) else True

    def watching(self) -> bool:
        """Whether a stall counts: the loop runs and no graceful stop is in progress."""
        return self.training_started and not self.training_done and self.stop_signal is None

    def request_stop(self, reason: str) -> None:
        """Forward a stop request to the trainer once it exists."""
        if self.trainer is not None:
            self.trainer.request_stop(reason)


def _configure_logging(logging_config: Any) -> logging.Handler:
    """Attach one stdout handler (text or JSON) to the ``speedtronic`` logger tree."""
    handler = logging.StreamHandler(sys.stdout)
    if getattr(logging_config, "format", "text") == "json":
        handler.setFormatter(JsonLogFormatter())
    else:
        handler.setFormatter(logging.Formatter(_TEXT_FORMAT))
    root = logging.getLogger("speedtronic")
    root.addHandler(handler)
    root.setLevel(getattr(logging_config, "level", "INFO"))
    return handler


def _log_startup(config: Any, sources: dict[str, str], json_logs: bool) -> None:
    redacted = config.to_dict(redact_secrets=True)
    versions = runtime_versions()
    if json_logs:
        _LOG.info(
            "speedtronic run starting",
            extra=_event("startup", versions=versions, config=redacted, sources=sources),
        )
        return
    cuda = versions["cuda"] or "none"
    _LOG.info(
        "speedtronic run starting: speedtronic %s, torch %s, CUDA %s (available: %s), python %s",
        versions["speedtronic"],
        versions["torch"],
        cuda,
        versions["cuda_available"],
        versions["python"],
    )
    _LOG.info("config (redacted): %s", json.dumps(redacted, sort_keys=True, default=str))
    _LOG.info("config sources: %s", json.dumps(sources, sort_keys=True))


def _metrics_enabled(config: Any) -> bool:
    metrics = getattr(config, "metrics", None)
    if metrics is None:
        return False
    return metrics.enabled is None or bool(metrics.enabled)


def _start_server(config: Any, registry: Any, state: _RunState) -> Any:
    """Bind and start the metrics server; None when ``metrics.enabled`` is false."""
    if not _metrics_enabled(config):
        _LOG.info("metrics server disabled (metrics.enabled=false)")
        return None
    from speedtronic.metrics.server import MetricsServer

    metrics = config.metrics
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


def _claim_identity(config: Any, sources: dict[str, str]) -> Any:
    """Give a worker without a node id a slot (when ``distributed.slots_dir`` is set) and
    put the node id into the ``{node_id}`` output paths; the `SlotClaim`, or None."""
    distributed = config.distributed
    claim = None
    if (
        distributed.enabled
        and distributed.role == "worker"
        and distributed.slots_dir
        and distributed.node_id is None
    ):
        from speedtronic.diloco.slots import claim_slot

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


def _expand_node_paths(config: Any) -> None:
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


def _start_watchdog(config: Any, state: _RunState) -> Any:
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


def _identity(config: Any, trainer: Any) -> tuple[str, str]:
    """(role, node_id) labels: the coordinator's when distributed, else the host name."""
    distributed = config.distributed
    coordinator = getattr(trainer, "coordinator", None)
    role = distributed.role if distributed.enabled else "single"
    node_id = getattr(coordinator, "node_id", None) or distributed.node_id or socket.gethostname()
    return str(getattr(coordinator, "role", None) or role), str(node_id)


def _install_signal_handlers(state: _RunState) -> Callable[[], None]:
    """SIGTERM/SIGINT → graceful stop; a second one raises KeyboardInterrupt (exit 130)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {sig: signal.getsignal(sig) for sig in _SIGNALS}

    def handle(signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        if state.stop_signal is not None:
            raise KeyboardInterrupt(f"second {name} while stopping")
        state.stop_signal = signum
        _LOG.info(
            "%s received: stopping at the next step boundary",
            name,
            extra=_event("stop_requested", signal=name),
        )
        state.request_stop(name)

    for sig in _SIGNALS:
        signal.signal(sig, handle)

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore


def _collision_hook(state: _RunState) -> Callable[[str, dict], None]:
    """A logger hook: a ``node_id_collision`` before training starts stops the run (exit 2).

    A collision reported later (another process claimed this id while we were training) is
    left to the coordinator's error log: stopping then would take down the original node.
    """

    def hook(event: str, payload: dict) -> None:
        if event == "train_start":
            state.training_started = True
        elif event == "node_id_collision" and not state.training_started and not state.collision:
            state.collision = str(payload.get("node_id"))
            state.request_stop("node_id_collision")

    return hook


def _collision_error(node_id: str) -> NodeIdCollisionError:
    return NodeIdCollisionError(
        f"distributed.node_id: another live node already uses node id {node_id!r}; give each "
        "worker a unique id (SPEEDTRONIC_NODE_ID, distributed.node_id, or a unique hostname)"
    )


def _build(config: Any, resume: bool) -> tuple[Any, Any]:
    from speedtronic.train.runtime import build_runtime

    return build_runtime(config, resume=resume)


def run_command(resolved: Any, *, resume: bool = False) -> int:
    """Run one training job as a container entrypoint; returns the process exit code.

    Args:
        resolved: a `ResolvedConfig` (``.config`` and ``.sources``) from ``resolve_config``.
        resume: resume from the newest local checkpoint (also ``checkpoint.resume``).

    Returns:
        0 on success or after a graceful SIGTERM/SIGINT stop; 128+signal when the graceful
        stop itself failed.

    Raises:
        ConfigError: configuration problems (exit 2 in the CLI): port in use, node-id
            collision, and whatever the runtime rejects before training.
        Exception: runtime failures (exit 1 in the CLI).
    """
    config = resolved.config
    sources = dict(getattr(resolved, "sources", {}) or {})
    handler = _configure_logging(config.logging)
    state = _RunState()
    server = watchdog = slot = None
    restore_signals: Callable[[], None] = lambda: None  # noqa: E731 - replaced below
    try:
        slot = _claim_identity(config, sources)
        _log_startup(config, sources, config.logging.format == "json")
        from prometheus_client import CollectorRegistry

        registry = CollectorRegistry()
        server = _start_server(config, registry, state)
        watchdog = _start_watchdog(config, state)
        restore_signals = _install_signal_handlers(state)
        return _train(config, resume, state, registry)
    finally:
        restore_signals()
        if watchdog is not None:
            watchdog.stop()
        if server is not None:
            server.stop()
        if slot is not None:
            slot.release()
        logging.getLogger("speedtronic").removeHandler(handler)


def _train(config: Any, resume: bool, state: _RunState, registry: Any) -> int:
    trainer, _manager = _build(config, resume)
    state.trainer = trainer
    role, node_id = _identity(config, trainer)
    from speedtronic.metrics.prometheus import PrometheusSink

    state.sink = PrometheusSink(role, node_id, registry=registry)
    trainer.logger.hooks.append(state.sink)
    trainer.logger.hooks.append(_collision_hook(state))
    state.built = True
    state.last_phase = time.monotonic()
    _LOG.info(
        "runtime built: role=%s node_id=%s",
        role,
        node_id,
        extra=_event("runtime_built", role=role, node_id=node_id),
    )
    if state.stop_signal is not None:
        _LOG.info("stop requested before training started; exiting without training")
        return 0
    try:
        result = trainer.fit()
        state.training_done = True
    except Exception:
        state.training_done = True
        if state.collision is not None:
            raise _collision_error(state.collision) from None
        if state.stop_signal is not None:
            _LOG.exception("graceful stop failed")
            return 128 + state.stop_signal
        raise
    if state.collision is not None:
        raise _collision_error(state.collision)
    reason = getattr(result, "stopped_reason", None)
    _LOG.info(
        "run finished: steps=%s stopped_reason=%s",
        getattr(result, "steps", None),
        reason,
        extra=_event("run_finished", steps=getattr(result, "steps", None), stopped_reason=reason),
    )
    return 0
