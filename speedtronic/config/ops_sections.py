"""Operational sections: checkpoint, logging, metrics, distributed, shape_validation.

Same conventions as :mod:`speedtronic.config.sections`: each field declared once (type,
default, bounds, help); ``__post_init__`` only relates fields. Durations that reach
``time.sleep``/``Event.wait`` are capped far below what could overflow them.
"""

from __future__ import annotations

import ipaddress
import logging
import re
from collections.abc import Mapping
from typing import Annotated, Literal

from pydantic import AfterValidator, BeforeValidator, Field, model_validator
from pydantic_core import ArgsKwargs

from speedtronic.config.fields import (
    CHOICE,
    STEPS,
    Bool,
    F,
    Float,
    Int,
    PathStr,
    Str,
    StrList,
    choice,
    describe,
    fields_of,
    section,
)
from speedtronic.config.limits import DAY, HOUR, WEEK, ConfigError, check_node_id, is_hub_repo_id
from speedtronic.config.redaction import REDACTED

__all__ = [
    "LOG_LEVELS",
    "TRACKERS",
    "CheckpointConfig",
    "DistributedConfig",
    "LoggingConfig",
    "MetricsConfig",
    "ShapeValidationConfig",
]

LOG_LEVELS = ("CRITICAL", "FATAL", "ERROR", "WARNING", "WARN", "INFO", "DEBUG", "NOTSET")
TRACKERS = ("tensorboard", "wandb")
_HOSTNAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def _exchange(value: str | None) -> str | None:
    """An exchange is ``owner/name`` (Hub) or ``file:///absolute/path`` (shared volume); a
    one-part id (``single``), spaces or a third part are refused here, at ``validate``,
    rather than by every upload of a run. The value is not echoed (it may hold a secret)."""
    if not value:
        return value
    if value.startswith("file:"):
        usable = value.startswith("file:///") and len(value) > len("file:///")
    else:  # a redacted record (a checkpoint's) reads back: the marker stands for a secret
        usable = is_hub_repo_id(value.replace(REDACTED, "x"))
    if not usable:
        raise ValueError("must be 'owner/name' (Hub) or 'file:///absolute/path'")
    return value


def _token(value: object) -> object:
    """The token without the whitespace a secret file or ``secretKeyRef`` adds; inner
    whitespace or control characters are refused (an HTTP header cannot carry them)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConfigError(f"distributed.token must be a string, got {describe(value, secret=True)}")
    token = value.strip()
    if any(char.isspace() or not char.isprintable() for char in token):
        raise ConfigError(
            "distributed.token contains whitespace or control characters inside it (the value "
            "is not shown); check HF_TOKEN or the hf_token secret file"
        )
    return str(token)


def _node_id(value: str | None) -> str | None:
    return None if value is None else check_node_id(value)


def _leaders(value: list[str]) -> list[str]:
    return [check_node_id(node, "distributed.relay_leaders") for node in value]


def _momentum_sync(value: object) -> object:
    """``sync_inner_momentum``: a choice; ``false`` (YAML's boolean or the word) is ``off``."""
    return "off" if value is False or choice(value) == "false" else choice(value)


def _plain_step(value: object) -> float | None:
    """A given ``outer_lr``/``outer_momentum`` as a number (None: not one; its field says so)."""
    try:
        return float(str(value).strip())
    except ValueError:
        return None


def _outer_step(named: dict[str, object]) -> dict[str, object]:
    """Resolve ``outer_step`` from the keys the input gave (see DistributedConfig)."""
    given = [k for k in ("outer_lr", "outer_momentum") if named.get(k) is not None]
    step = choice(named.get("outer_step"))
    if step is None:  # 2.0.0's configs set outer_lr/outer_momentum: they keep their meaning
        step = named["outer_step"] = "nesterov" if given else "adaptive"
    if "final_average" not in named:  # the final mean goes with the extrapolated steps
        named["final_average"] = 2 if step == "adaptive" else 1
    if step not in ("average", "adaptive"):
        return named  # nesterov, or a wrong value its field reports
    lr = "eta" if step == "adaptive" else "1.0"
    for name, plain in (("outer_lr", 1.0), ("outer_momentum", 0.0)):
        if name in given and _plain_step(named[name]) != plain:
            raise ConfigError(
                f"distributed.outer_step is {step!r} (outer lr {lr}, no momentum) but "
                f"distributed.{name} is {describe(named[name])}: set "
                f"distributed.outer_step: nesterov to use outer_lr/outer_momentum, or drop "
                f"distributed.{name}"
            )
    named.update(outer_lr=1.0, outer_momentum=0.0)
    return named


def _host(value: str) -> str:
    """``metrics.host``: an IP address or a host name (checked now, not when binding)."""
    host = value.strip()
    if not host:
        raise ConfigError("metrics.host must not be empty")
    try:
        ipaddress.ip_address(host.strip("[]"))
        return host
    except ValueError:
        pass
    numeric = all(part.isdigit() for part in host.split("."))
    if numeric or len(host) > 253 or not all(_HOSTNAME.fullmatch(p) for p in host.split(".")):
        raise ConfigError(
            f"metrics.host must be an IP address or a host name, got {describe(host)} "
            "(0.0.0.0 listens on every interface, 127.0.0.1 on this machine only)"
        )
    return host


def _level(value: object) -> object:
    return value.strip().upper() if isinstance(value, str) else value


def _alignment(value: object) -> object:
    """``auto`` (also for null), ``none``, or a positive integer (not a bool or a float)."""
    if value is None:
        return "auto"
    text = "shape_validation.alignment must be"
    if isinstance(value, str) and choice(value) not in ("auto", "none"):
        raise ConfigError(f"{text} 'auto', 'none', or a positive integer")
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ConfigError(f"{text} 'auto' or a positive integer, got {describe(value)}")
    return choice(value)


Level = Annotated[
    Literal["CRITICAL", "FATAL", "ERROR", "WARNING", "WARN", "INFO", "DEBUG", "NOTSET"],
    BeforeValidator(_level),
]
LogFormat = Annotated[Literal["text", "json"], CHOICE]
Trackers = list[Annotated[Literal["tensorboard", "wandb"], CHOICE]]
Host = Annotated[Str, AfterValidator(_host)]
Mode = Annotated[Literal["dumb_diloco", "single"], CHOICE]
RoleName = Literal["single", "master", "worker"]
Role = Annotated[RoleName, CHOICE]
NodeId = Annotated[Str, AfterValidator(_node_id)]
Sync = Annotated[Literal["blocking", "overlapped"], CHOICE]
Exchange = Annotated[PathStr, AfterValidator(_exchange)]
Leaders = Annotated[StrList, AfterValidator(_leaders)]
Token = Annotated[str, BeforeValidator(_token)]
DeltaDtype = Annotated[Literal["fp32", "bf16", "fp16", "int8", "int4"], CHOICE]
GlobalDtype = Annotated[Literal["fp32", "int8", "int4"], CHOICE]
OuterStep = Annotated[Literal["average", "nesterov", "adaptive"], CHOICE]
MomentumSync = Annotated[Literal["off", "every_round", "every_n"], BeforeValidator(_momentum_sync)]
Alignment = Annotated[
    Literal["auto", "none"] | Annotated[int, Field(strict=True, gt=0, le=4096)],
    BeforeValidator(_alignment),
]


@section("checkpoint")
class CheckpointConfig:
    """Local checkpoints: ``directory`` is relative to ``run.output_dir`` unless absolute."""

    enabled: Bool = F(True, "write checkpoints")
    directory: PathStr = F("checkpoints", "relative to run.output_dir unless absolute")
    every_steps: Int = F(500, "cadence (checked even when disabled)", **STEPS)
    keep_last: Int | None = F(3, "keep the newest N (null: keep all)", gt=0, le=10**6)
    resume: Bool = F(False, "always try to resume (OR-ed with --resume)")
    overwrite: Bool = F(False, "start a new run over another run's checkpoints (deletes them)")
    save_final: Bool = F(True, "save at the end of a run and on SIGTERM")


@section("logging")
class LoggingConfig:
    """Text log (stdout or ``file``), JSONL events (``json_file``), ``train_step`` cadence, and
    the experiment trackers the metrics also go to (``trackers``, optional extras)."""

    level: Level = F("INFO", "log level (any case)")
    file: PathStr | None = F(None, "text log file instead of stdout (under run.output_dir)")
    every_steps: Int = F(1, "train_step event cadence", **STEPS)
    json_file: PathStr | None = F(None, "JSONL event file (under run.output_dir)")
    format: LogFormat = F("text", "text, or json (one JSON object per log line)")
    trackers: Trackers = F([], "experiment trackers: tensorboard, wandb")
    project: Str | None = F(None, "tracker project; null: run.name")
    run_name: Str | None = F(None, "tracker run name; null: the node id")

    @property
    def level_number(self) -> int:
        """The numeric ``logging`` level."""
        return logging.getLevelName(self.level) if self.level != "WARN" else logging.WARNING


@section("metrics")
class MetricsConfig:
    """Prometheus ``/metrics`` + ``/healthz`` + ``/readyz`` server."""

    enabled: Bool | None = F(None, "null: on under `speedtronic run`, off under `train`")
    host: Host = F("0.0.0.0", "bind address: an IP address or a host name")
    port: Int = F(8000, "port (0: any free port)", ge=0, le=65535)
    stall_seconds: Float = F(300.0, "/healthz fails after a heartbeat this old", gt=0, le=WEEK)


@section("distributed")
class DistributedConfig:
    """DumbDiLoCo: local inner steps, then a pseudo-gradient exchange through ``repo_id``.

    Rounds: an outer step averages one contribution per node; docs/diloco.md explains
    ``sync``, ``round_timeout``, ``min_nodes``, ``expected_nodes``, ``max_staleness``,
    ``drop_after`` and relays.
    ``token`` is a secret: redacted on save, in ``validate``/``config show`` and checkpoints.
    """

    enabled: Bool = F(False, "run DumbDiLoCo")
    mode: Mode = F("dumb_diloco", "dumb_diloco or single")
    role: Role = F("single", "single, master or worker; enabled + single becomes master")
    node_id: NodeId | None = F(None, "path-safe node id; null: SPEEDTRONIC_NODE_ID, HOSTNAME, ...")
    collaborators: StrList = F([], "Hub usernames the master grants write access")
    inner_steps: Int = F(500, "local steps per round", **STEPS)
    poll_interval: Float = F(60.0, "seconds between polls of the exchange", ge=0.001, le=DAY)
    sync: Sync = F("blocking", "blocking: wait for the round's global; overlapped: keep training")
    overlap_steps: Int | None = F(
        None,
        "overlapped: steps until a contribution's global merges (<= inner_steps); null: 1/10 of it",
        **STEPS,
    )
    fragments: Int = F(
        1, "streamed: the model in N parts, one synced per round of inner_steps / N", ge=1, le=64
    )
    round_timeout: Float = F(
        120.0, "seconds a round waits after its first on-time delta", gt=0, le=WEEK
    )
    min_nodes: Int = F(1, "fewest contributing nodes per round", ge=1, le=10_000)
    expected_nodes: Int = F(
        0,
        "nodes of the run (a training master counts): round 0 waits for them; 0: no wait",
        ge=0,
        le=10_000,
    )
    max_staleness: Int = F(1, "rounds late a contribution may be and still count", ge=0, le=1000)
    drop_after: Int = F(3, "silent round lengths before a node is not waited for", ge=1, le=1000)
    heartbeat_interval: Float | None = F(
        None, "seconds between liveness beats; null: 3 (file://), 30 (Hub)", ge=0.1, le=HOUR
    )
    liveness_timeout: Float | None = F(
        None, "no beat this long: dropped; null: 10 (file://), 120 (Hub); 0: off", ge=0, le=DAY
    )
    train: Bool = F(True, "false on the master: a pure aggregator")
    relay_to: Exchange | None = F(None, "on a group leader: the top-level exchange")
    relay_leaders: Leaders = F([], "on the top-level master: the group leaders' node ids")
    outer_step: OuterStep = F(
        "adaptive",
        "adaptive (lr eta), average (lr 1, no momentum) or nesterov (outer_lr/outer_momentum)",
    )
    outer_lr: Float = F(0.7, "outer Nesterov learning rate (outer_step: nesterov)", gt=0, le=10.0)
    outer_momentum: Float = F(0.9, "outer Nesterov momentum (outer_step: nesterov)", ge=0, lt=1.0)
    adaptive_c: Float = F(
        0.75,
        "adaptive: eta = c x mean squared delta norm / squared norm of the mean",
        gt=0,
        le=10.0,
    )
    adaptive_max: Float = F(2.0, "adaptive: the largest eta (it is at least 1)", ge=1.0, le=10.0)
    final_average: Int = F(
        2,
        "the final model: the mean of the last N globals (default: 2 with adaptive, else 1)",
        ge=1,
        le=16,
    )
    sync_inner_momentum: MomentumSync = F(
        "off", "average the inner AdamW first moment: off, every_round or every_n"
    )
    inner_momentum_every: Int = F(
        2, "every_n: the rounds between two first-moment averages", ge=1, le=10_000
    )
    repo_id: Exchange | None = F(None, "owner/name (Hub) or file:///abs/path (shared volume)")
    token: Token | None = F(None, "Hub token (secret): prefer HF_TOKEN or the hf_token file")
    cache_dir: PathStr = F(".speedtronic/hub", "Hub cache (relative to the CWD)")
    state_dir: PathStr = F(".speedtronic/diloco", "relative to run.output_dir, then /<node_id>")
    retry_initial: Float = F(1.0, "first retry delay, seconds", gt=0, le=HOUR)
    retry_max: Float = F(60.0, "largest retry delay, seconds", gt=0, le=DAY)
    retry_attempts: Int = F(6, "attempts per transport operation", gt=0, le=100)
    reset_inner_optimizer: Bool = F(False, "clear the inner optimizer state at each merge")
    async_delta_upload: Bool = F(True, "upload in the background (sync: overlapped)")
    delta_upload_shutdown_timeout: Float = F(
        5.0, "seconds to finish an upload at shutdown", gt=0, le=HOUR
    )
    async_global_poll: Bool = F(True, "poll for the global state in the background")
    delta_dtype: DeltaDtype = F(
        "fp32", "upload format: fp32, bf16, fp16, int8 or int4 (+ error feedback)"
    )
    delta_block_size: Int = F(128, "values per scale of an int8/int4 delta", ge=8, le=1 << 20)
    error_feedback: Bool = F(True, "keep what a lossy delta/global format left out; send it next")
    global_dtype: GlobalDtype = F(
        "fp32",
        "global download: fp32 (full; a fragment's new values with fragments), or int8/int4 "
        "(the quantized outer update)",
    )
    request_timeout: Float = F(60.0, "seconds one transport call may take", gt=0, le=DAY)
    slots_dir: PathStr | None = F(None, "shared folder where workers claim worker-<n> ids")

    @model_validator(mode="before")
    @classmethod
    def _resolve_outer_step(cls, values: object) -> object:
        """``outer_step`` not given: ``nesterov`` when ``outer_lr`` or ``outer_momentum`` is
        (a 2.0.0 config keeps its meaning), else ``adaptive``; ``final_average`` not given: 2
        with ``adaptive``, else 1. ``average`` and ``adaptive`` hold ``outer_lr`` 1.0 and
        ``outer_momentum`` 0.0 (so a saved config reads back the same); another value given
        beside them is a ConfigError naming both fields."""
        if isinstance(values, ArgsKwargs) and not values.args:  # a constructor call
            return ArgsKwargs((), _outer_step(dict(values.kwargs or {})))
        if isinstance(values, Mapping):
            return _outer_step({str(k): v for k, v in values.items()})
        return values

    def __post_init__(self) -> None:
        if self.enabled and self.mode != "dumb_diloco":
            raise ConfigError("distributed.mode must be 'dumb_diloco' when enabled")
        if self.enabled:
            self.role = self.node_role
        if not self.train and self.role == "worker":
            raise ConfigError(
                "distributed.train: false is only valid on the master (a pure aggregator)"
            )
        if self.relay_to is not None and self.role != "master":
            raise ConfigError(
                "distributed.relay_to is set on a group leader, which is the master of its "
                "group's exchange (distributed.role: master)"
            )
        if self.relay_to is not None and self.relay_to == self.repo_id:
            raise ConfigError(
                "distributed.relay_to must name the top-level exchange, not the group's "
                "own distributed.repo_id"
            )
        self._check_rounds()
        if self.retry_max < self.retry_initial:
            raise ConfigError(
                "distributed retry bounds are invalid (distributed.retry_max must be >= "
                "distributed.retry_initial)"
            )
        if self.enabled and not self.repo_id:
            raise ConfigError("distributed.repo_id is required for DumbDiLoCo")
        self._check_membership()

    @property
    def liveness(self) -> tuple[float, float]:
        """``(heartbeat_interval, liveness_timeout)``, null as the transport's default."""
        hub, timeout = not (self.repo_id or "file:").startswith("file:"), self.liveness_timeout
        interval = self.heartbeat_interval or (30.0 if hub else 3.0)
        return interval, (120.0 if hub else 10.0) if timeout is None else timeout

    def _check_membership(self) -> None:
        """Orders that cannot work (docs/diloco.md, "Timeouts, from fastest to slowest")."""
        interval, timeout = self.liveness
        if 0 < timeout <= 2 * interval:
            raise ConfigError(
                f"distributed.liveness_timeout ({timeout:g} s) must exceed 2 x "
                f"distributed.heartbeat_interval ({interval:g} s): a live node would be taken "
                "for dead between two beats (0 turns liveness off)"
            )
        if 0 < self.expected_nodes < self.min_nodes:
            raise ConfigError(
                f"distributed.min_nodes ({self.min_nodes}) exceeds distributed.expected_nodes "
                f"({self.expected_nodes}): no round of the run could close"
            )

    def _check_rounds(self) -> None:
        """A round is ``inner_steps / fragments`` steps (every fragment is synced every
        ``inner_steps``), and an overlapped node merges a round's global before the next
        sync of its tensors (several rounds may be in flight with fragments)."""
        if self.inner_steps % self.fragments:
            raise ConfigError(
                f"distributed.fragments: {self.fragments} must divide distributed.inner_steps "
                f"({self.inner_steps}): a round syncs one fragment every inner_steps / fragments "
                "steps"
            )
        if self.overlap_steps is not None and self.overlap_steps > self.inner_steps:
            raise ConfigError(
                f"distributed.overlap_steps: {self.overlap_steps} is longer than "
                f"distributed.inner_steps ({self.inner_steps}): a tensor's global must be merged "
                "before its next sync"
            )
        if self.fragments > 1 and self.sync_inner_momentum != "off":
            raise ConfigError(
                "distributed.fragments > 1 syncs a part of the model per round; "
                "distributed.sync_inner_momentum needs whole rounds: set it off"
            )
        if self.fragments > 1 and (self.relay_to is not None or self.relay_leaders):
            raise ConfigError(
                "distributed.fragments > 1 is not supported with relays (distributed.relay_to, "
                "distributed.relay_leaders): a group leader forwards whole rounds"
            )

    @property
    def node_role(self) -> RoleName:
        """The role a node plays: ``role``, where ``single`` means master when ``repo_id`` is
        set (the node creates the exchange) and worker otherwise. Enabling DiLoCo applies it."""
        if self.role != "single":
            return self.role
        return "master" if self.repo_id else "worker"

    def __repr__(self) -> str:
        shown = {name: getattr(self, name) for name in fields_of(type(self))}
        if shown["token"]:
            shown["token"] = REDACTED
        inner = ", ".join(f"{name}={value!r}" for name, value in shown.items())
        return f"DistributedConfig({inner})"


@section("shape_validation")
class ShapeValidationConfig:
    """Startup tensor-shape alignment warnings (never fatal, never modify the config)."""

    enabled: Bool = F(True, "startup shape-alignment warnings")
    alignment: Alignment = F("auto", "auto, none, or a positive integer")
    check_batch: Bool = F(True, "check the micro batch")
    check_sequence: Bool = F(True, "check block size and micro x block")
    check_model: Bool = F(True, "check layer widths")
    check_vocab: Bool = F(False, "check model.vocab_size")
    warn_on_cpu: Bool = F(False, "warn on CPU/MPS too (explicit alignment)")
