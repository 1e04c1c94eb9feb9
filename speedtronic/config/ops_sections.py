"""Operational section dataclasses: checkpoint, logging, metrics, distributed, shape_validation.

Same conventions as :mod:`speedtronic.config.sections`: mutable dataclasses, coercion then the
2.0.0 range checks in ``__post_init__``, type errors naming the field, then the upper bounds of
:mod:`speedtronic.config.limits` (durations that reach ``time.sleep``/``Event.wait`` are
capped far below what could overflow them).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from speedtronic.config.coercion import (
    describe,
    to_bool,
    to_float,
    to_int,
    to_path,
    to_str,
    to_str_list,
)
from speedtronic.config.errors import ConfigError
from speedtronic.config.limits import (
    MAX_STEPS,
    at_most,
    blame,
    check_node_id,
    in_range,
)
from speedtronic.config.sections import _choice

__all__ = [
    "LOG_LEVELS",
    "CheckpointConfig",
    "DistributedConfig",
    "LoggingConfig",
    "MetricsConfig",
    "ShapeValidationConfig",
]

LOG_LEVELS = ("CRITICAL", "FATAL", "ERROR", "WARNING", "WARN", "INFO", "DEBUG", "NOTSET")
HOUR, DAY, WEEK = 3600.0, 86400.0, 604800.0


def _check_exchange(value: str, field: str) -> None:
    """An exchange is ``owner/name`` (Hub) or ``file:///absolute/path`` (shared volume)."""
    if value.startswith("file:") and not (
        value.startswith("file:///") and len(value) > len("file:///")
    ):
        raise ConfigError(f"{field} must be 'owner/name' (Hub) or 'file:///absolute/path'")


def _token(value: Any) -> str | None:
    """The token without the whitespace a secret file or ``secretKeyRef`` adds; inner
    whitespace or control characters are refused (an HTTP header cannot carry them)."""
    token = to_str(value, "distributed.token", nullable=True, secret=True)
    if token is None:
        return None
    token = token.strip()
    if any(char.isspace() or not char.isprintable() for char in token):
        raise ConfigError(
            "distributed.token contains whitespace or control characters inside it (the value "
            "is not shown); check HF_TOKEN or the hf_token secret file"
        )
    return token


@dataclass
class CheckpointConfig:
    """Local checkpoints: ``directory`` is relative to ``run.output_dir`` unless absolute."""

    enabled: bool = True
    directory: str = "checkpoints"
    every_steps: int = 500
    keep_last: int | None = 3
    resume: bool = False
    save_final: bool = True

    def __post_init__(self) -> None:
        self.enabled = to_bool(self.enabled, "checkpoint.enabled")
        self.directory = to_path(self.directory, "checkpoint.directory")
        self.every_steps = to_int(self.every_steps, "checkpoint.every_steps")
        self.keep_last = to_int(self.keep_last, "checkpoint.keep_last", nullable=True)
        self.resume = to_bool(self.resume, "checkpoint.resume")
        self.save_final = to_bool(self.save_final, "checkpoint.save_final")
        if self.every_steps <= 0:
            raise ConfigError("checkpoint.every_steps must be positive")
        if self.keep_last is not None and self.keep_last <= 0:
            raise ConfigError("checkpoint.keep_last must be positive or null")
        at_most(self.every_steps, "checkpoint.every_steps", MAX_STEPS)
        at_most(self.keep_last, "checkpoint.keep_last", 10**6)


@dataclass
class LoggingConfig:
    """Text log (stdout or ``file``), JSONL events (``json_file``), ``train_step`` cadence.

    ``format: json`` turns the text lines into JSON objects. Paths are relative to the CWD.
    """

    level: str = "INFO"
    file: str | None = None
    every_steps: int = 1
    json_file: str | None = None
    format: str = "text"

    def __post_init__(self) -> None:
        self.every_steps = to_int(self.every_steps, "logging.every_steps")
        if self.every_steps <= 0:
            raise ConfigError("logging.every_steps must be positive")
        at_most(self.every_steps, "logging.every_steps", MAX_STEPS)
        level = to_str(self.level, "logging.level").strip().upper()
        if level not in LOG_LEVELS:
            raise ConfigError(
                f"logging.level must be one of {', '.join(LOG_LEVELS)}, got {describe(self.level)}"
            )
        self.level = level
        self.file = to_path(self.file, "logging.file", nullable=True)
        self.json_file = to_path(self.json_file, "logging.json_file", nullable=True)
        self.format = _choice(
            self.format,
            "logging.format",
            ("text", "json"),
            "logging.format must be 'text' or 'json'",
        )

    @property
    def level_number(self) -> int:
        """The numeric ``logging`` level."""
        return logging.getLevelName(self.level) if self.level != "WARN" else logging.WARNING


@dataclass
class MetricsConfig:
    """Prometheus ``/metrics`` + ``/healthz`` + ``/readyz`` server.

    ``enabled: null`` means on under ``speedtronic run`` and off under ``speedtronic train``.
    ``stall_seconds``: ``/healthz`` fails when the training heartbeat is older than this.
    """

    enabled: bool | None = None
    host: str = "0.0.0.0"
    port: int = 8000
    stall_seconds: float = 300.0

    def __post_init__(self) -> None:
        self.enabled = to_bool(self.enabled, "metrics.enabled", nullable=True)
        self.host = to_str(self.host, "metrics.host").strip()
        self.port = to_int(self.port, "metrics.port")
        self.stall_seconds = to_float(self.stall_seconds, "metrics.stall_seconds")
        if not self.host:
            raise ConfigError("metrics.host must not be empty")
        if not 0 <= self.port <= 65535:
            raise ConfigError("metrics.port must be between 0 and 65535")
        if self.stall_seconds <= 0:
            raise ConfigError("metrics.stall_seconds must be positive")
        at_most(self.stall_seconds, "metrics.stall_seconds", WEEK)


@dataclass
class DistributedConfig:
    """DumbDiLoCo: local inner steps, then a pseudo-gradient exchange through ``repo_id``.

    ``repo_id`` is a Hub repo (``owner/name``) or ``file:///abs/path`` (shared volume).
    ``token`` is a secret: redacted on save, in ``validate``/``config show`` and checkpoints.
    ``state_dir`` is relative to ``run.output_dir``; ``cache_dir`` to the CWD.

    Rounds: an outer step averages one contribution per node. ``sync`` is how a node waits
    for the next global (``blocking``: right after its upload; ``overlapped``: keeps
    training and merges the global when it arrives). The master closes a round when every
    active node delivered (and at least ``min_nodes``), or ``round_timeout`` seconds after
    the round's first contribution; a contribution at most ``max_staleness`` rounds late is
    folded into the open round, older ones are dropped. A node silent for ``drop_after``
    round lengths leaves the expected set until it delivers again. ``train: false`` makes
    the master a pure aggregator. ``relay_leaders`` (top-level master): the node ids of the
    group leaders (``relay_to``) whose contribution may weigh as many nodes as their group.
    """

    enabled: bool = False
    mode: str = "dumb_diloco"
    role: str = "single"
    node_id: str | None = None
    collaborators: list[str] = field(default_factory=list)
    inner_steps: int = 500
    poll_interval: float = 60.0
    sync: str = "blocking"
    round_timeout: float = 120.0
    min_nodes: int = 1
    max_staleness: int = 1
    drop_after: int = 3
    train: bool = True
    relay_to: str | None = None
    relay_leaders: list[str] = field(default_factory=list)
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    repo_id: str | None = None
    token: str | None = None
    cache_dir: str = ".speedtronic/hub"
    state_dir: str = ".speedtronic/diloco"
    retry_initial: float = 1.0
    retry_max: float = 60.0
    retry_attempts: int = 6
    reset_inner_optimizer: bool = False
    async_delta_upload: bool = True
    delta_upload_shutdown_timeout: float = 5.0
    async_global_poll: bool = True
    delta_dtype: str = "fp32"
    delta_block_size: int = 128  # values per float32 scale of an int8/int4 delta
    request_timeout: float = 60.0
    # Shared directory where a worker without a node id claims a stable one (``worker-<n>``,
    # see speedtronic.slots); relative to the CWD. None: no slots.
    slots_dir: str | None = None

    def __post_init__(self) -> None:
        self._coerce()
        self.mode = _choice(
            self.mode,
            "distributed.mode",
            ("dumb_diloco", "single"),
            "distributed.mode must be 'dumb_diloco' or 'single'",
        )
        if self.enabled and self.mode != "dumb_diloco":
            raise ConfigError("distributed.mode must be 'dumb_diloco' when enabled")
        self.role = _choice(
            self.role,
            "distributed.role",
            ("single", "master", "worker"),
            "distributed.role must be single, master, or worker",
        )
        if self.enabled and self.role == "single":
            self.role = "master" if self.repo_id else "worker"
        if self.node_id is not None:
            self.node_id = check_node_id(self.node_id)
        self.collaborators = to_str_list(
            self.collaborators,
            "distributed.collaborators",
            "distributed.collaborators must be a list of usernames",
        )
        self.relay_leaders = [
            check_node_id(node, "distributed.relay_leaders")
            for node in to_str_list(
                self.relay_leaders,
                "distributed.relay_leaders",
                "distributed.relay_leaders must be a list of the group leaders' node ids",
            )
        ]
        if self.inner_steps <= 0:
            raise ConfigError("distributed.inner_steps must be positive")
        if self.poll_interval <= 0:
            raise ConfigError("distributed.poll_interval must be positive")
        self.sync = _choice(
            self.sync,
            "distributed.sync",
            ("blocking", "overlapped"),
            "distributed.sync must be 'blocking' or 'overlapped'",
        )
        if self.round_timeout <= 0:
            raise ConfigError("distributed.round_timeout must be positive")
        if self.min_nodes < 1:
            raise ConfigError("distributed.min_nodes must be at least 1")
        if self.max_staleness < 0:
            raise ConfigError("distributed.max_staleness cannot be negative")
        if self.drop_after < 1:
            raise ConfigError("distributed.drop_after must be at least 1")
        if not self.train and self.role == "worker":
            raise ConfigError(
                "distributed.train: false is only valid on the master (a pure aggregator)"
            )
        if self.relay_to is not None:
            if self.role != "master":
                raise ConfigError(
                    "distributed.relay_to is set on a group leader, which is the master of its "
                    "group's exchange (distributed.role: master)"
                )
            if self.relay_to == self.repo_id:
                raise ConfigError(
                    "distributed.relay_to must name the top-level exchange, not the group's "
                    "own distributed.repo_id"
                )
            _check_exchange(self.relay_to, "distributed.relay_to")
        if self.outer_lr <= 0 or not 0.0 <= self.outer_momentum < 1.0:
            bad = {"distributed.outer_lr": self.outer_lr} if self.outer_lr <= 0 else {}
            if not 0.0 <= self.outer_momentum < 1.0:
                bad["distributed.outer_momentum"] = self.outer_momentum
            raise blame("outer learning rate/momentum values are invalid", bad, lambda v: True)
        if self.retry_initial <= 0 or self.retry_max < self.retry_initial:
            bounds = {"distributed.retry_initial": self.retry_initial}
            bounds["distributed.retry_max"] = self.retry_max
            raise blame("distributed retry bounds are invalid", bounds, lambda v: True)
        if self.retry_attempts < 1:
            raise ConfigError("distributed.retry_attempts must be positive")
        if self.delta_upload_shutdown_timeout <= 0:
            raise ConfigError("distributed.delta_upload_shutdown_timeout must be positive")
        self.delta_dtype = _choice(
            self.delta_dtype,
            "distributed.delta_dtype",
            ("fp32", "bf16", "fp16", "int8", "int4"),
            "distributed.delta_dtype must be fp32, bf16, fp16, int8, or int4",
        )
        in_range(self.delta_block_size, "distributed.delta_block_size", 8, 1 << 20)
        if self.request_timeout <= 0:
            raise ConfigError("distributed.request_timeout must be positive")
        if self.repo_id:
            _check_exchange(self.repo_id, "distributed.repo_id")
        if self.enabled and not self.repo_id:
            raise ConfigError("distributed.repo_id is required for DumbDiLoCo")
        self._check_upper_bounds()

    def _check_upper_bounds(self) -> None:
        """Counts stay countable and every duration fits ``time.sleep``/``Event.wait``."""
        at_most(self.inner_steps, "distributed.inner_steps", MAX_STEPS)
        in_range(self.poll_interval, "distributed.poll_interval", 0.001, DAY)
        at_most(self.round_timeout, "distributed.round_timeout", WEEK)
        at_most(self.min_nodes, "distributed.min_nodes", 10_000)
        at_most(self.max_staleness, "distributed.max_staleness", 1000)
        at_most(self.drop_after, "distributed.drop_after", 1000)
        at_most(self.outer_lr, "distributed.outer_lr", 10.0)
        at_most(self.retry_initial, "distributed.retry_initial", HOUR)
        at_most(self.retry_max, "distributed.retry_max", DAY)
        at_most(self.retry_attempts, "distributed.retry_attempts", 100)
        at_most(
            self.delta_upload_shutdown_timeout, "distributed.delta_upload_shutdown_timeout", HOUR
        )
        at_most(self.request_timeout, "distributed.request_timeout", DAY)

    def _coerce(self) -> None:
        self.enabled = to_bool(self.enabled, "distributed.enabled")
        self.node_id = to_str(self.node_id, "distributed.node_id", nullable=True)
        self.inner_steps = to_int(self.inner_steps, "distributed.inner_steps")
        self.poll_interval = to_float(self.poll_interval, "distributed.poll_interval")
        self.round_timeout = to_float(self.round_timeout, "distributed.round_timeout")
        self.min_nodes = to_int(self.min_nodes, "distributed.min_nodes")
        self.max_staleness = to_int(self.max_staleness, "distributed.max_staleness")
        self.drop_after = to_int(self.drop_after, "distributed.drop_after")
        self.train = to_bool(self.train, "distributed.train")
        self.relay_to = to_path(self.relay_to, "distributed.relay_to", nullable=True)
        self.outer_lr = to_float(self.outer_lr, "distributed.outer_lr")
        self.outer_momentum = to_float(self.outer_momentum, "distributed.outer_momentum")
        self.repo_id = to_path(self.repo_id, "distributed.repo_id", nullable=True)
        self.token = _token(self.token)
        self.cache_dir = to_path(self.cache_dir, "distributed.cache_dir")
        self.state_dir = to_path(self.state_dir, "distributed.state_dir")
        self.retry_initial = to_float(self.retry_initial, "distributed.retry_initial")
        self.retry_max = to_float(self.retry_max, "distributed.retry_max")
        self.retry_attempts = to_int(self.retry_attempts, "distributed.retry_attempts")
        for name in ("reset_inner_optimizer", "async_delta_upload", "async_global_poll"):
            setattr(self, name, to_bool(getattr(self, name), f"distributed.{name}"))
        self.delta_upload_shutdown_timeout = to_float(
            self.delta_upload_shutdown_timeout, "distributed.delta_upload_shutdown_timeout"
        )
        self.request_timeout = to_float(self.request_timeout, "distributed.request_timeout")
        self.delta_block_size = to_int(self.delta_block_size, "distributed.delta_block_size")
        self.slots_dir = to_path(self.slots_dir, "distributed.slots_dir", nullable=True)

    def __repr__(self) -> str:
        shown = {name: getattr(self, name) for name in self.__dataclass_fields__}
        if shown["token"]:
            shown["token"] = "<redacted>"
        inner = ", ".join(f"{name}={value!r}" for name, value in shown.items())
        return f"DistributedConfig({inner})"


_SHAPE_FLAGS = ("check_batch", "check_sequence", "check_model", "check_vocab", "warn_on_cpu")


@dataclass
class ShapeValidationConfig:
    """Startup tensor-shape alignment warnings (never fatal, never modify the config)."""

    enabled: bool = True
    alignment: Any = "auto"
    check_batch: bool = True
    check_sequence: bool = True
    check_model: bool = True
    check_vocab: bool = False
    warn_on_cpu: bool = False

    def __post_init__(self) -> None:
        self.enabled = to_bool(self.enabled, "shape_validation.enabled")
        self.alignment = self._coerce_alignment(self.alignment)
        for name in _SHAPE_FLAGS:
            setattr(self, name, to_bool(getattr(self, name), f"shape_validation.{name}"))

    @staticmethod
    def _coerce_alignment(value: Any) -> int | str:
        if value is None:
            return "auto"
        if isinstance(value, str):
            text = value.strip().lower()
            if text not in {"auto", "none"}:
                raise ConfigError(
                    "shape_validation.alignment must be 'auto', 'none', or a positive integer"
                )
            return text
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(
                "shape_validation.alignment must be 'auto' or a positive integer, "
                f"got {describe(value)}"
            )
        if value <= 0:
            raise ConfigError("shape_validation.alignment must be positive")
        return int(at_most(value, "shape_validation.alignment", 4096))
