"""The aggregate :class:`SpeedtronicConfig`: sections, normalisation, serialisation, paths.

An unset ``scheduler.max_steps`` follows the effective run target (``data.max_steps``, else
``run.max_steps``): filled in at construction, moved by :meth:`~SpeedtronicConfig.apply_run_target`
or :meth:`~SpeedtronicConfig.sync_scheduler_horizon`. An explicit horizon is never touched.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic.fields import FieldInfo

from speedtronic.config.fields import Bool, F, Int, fields_of, section
from speedtronic.config.limits import ConfigError, path_kind_problem
from speedtronic.config.loading import (
    ROOT_FIELDS,
    SECTION_NAMES,
    canonicalize,
    looks_inline,
    read_config_file,
    read_source,
    section_mapping,
    unknown_keys_message,
    with_origin,
)
from speedtronic.config.ops_sections import (
    CheckpointConfig,
    DistributedConfig,
    LoggingConfig,
    MetricsConfig,
    ShapeValidationConfig,
)
from speedtronic.config.redaction import REDACTED, scrub
from speedtronic.config.sections import (
    DataConfig,
    EvalConfig,
    ModelConfig,
    OptimizerConfig,
    PrecisionConfig,
    RunConfig,
    RuntimeConfig,
    SchedulerConfig,
)

__all__ = [
    "SECTION_CLASSES",
    "Config",
    "SpeedtronicConfig",
    "build_section",
    "config_warnings",
    "field_infos",
]


def field_infos() -> dict[str, FieldInfo]:
    """Every dotted field name -> its pydantic ``FieldInfo`` (type, default, bounds, help)."""
    result = {
        f"{name}.{field}": info
        for name, cls in SECTION_CLASSES.items()
        for field, info in fields_of(cls).items()
    }
    fields = fields_of(SpeedtronicConfig)
    result.update({name: fields[name] for name in ROOT_FIELDS})
    return result


def build_section(name: str, value: object) -> object:
    """Build section ``name`` from a mapping, ``None`` (defaults) or an existing instance."""
    cls = SECTION_CLASSES[name]
    if isinstance(value, cls):
        return value
    values = section_mapping({name: value}, name)
    fields = fields_of(cls)
    unknown = set(values) - set(fields)
    if unknown:
        raise ConfigError(unknown_keys_message(unknown, f"{name}: ", fields))
    return cls(**{str(key): item for key, item in values.items()})


def _plain(value: object, secrets: list[str] | None = None) -> object:
    """JSON/YAML-friendly builtins (tuples -> lists, Paths -> str) of a deep copy; with
    ``secrets``, every string is scrubbed of them (any spelling) and of token-shaped text."""
    if isinstance(value, Mapping):
        return {str(key): _plain(item, secrets) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item, secrets) for item in value]
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, str) and secrets is not None:
        return scrub(value, secrets)
    return value


@section("")
class SpeedtronicConfig:
    """The whole run configuration: thirteen sections plus four root scalars."""

    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    precision: PrecisionConfig = dataclasses.field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    shape_validation: ShapeValidationConfig = dataclasses.field(
        default_factory=ShapeValidationConfig
    )
    metrics: MetricsConfig = dataclasses.field(default_factory=MetricsConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    runtime: RuntimeConfig = dataclasses.field(default_factory=RuntimeConfig)
    gradient_checkpointing: Bool = F(False, "activation checkpointing (OR-ed with model's flag)")
    compile: Bool = F(False, "torch.compile the model (also compile: {enabled: ...})")
    ooo_backprop: Bool = F(False, "out-of-order backprop streams (CUDA only)")
    ooo_streams: Int = F(4, "streams for ooo_backprop", ge=1, le=8)

    def __post_init__(self) -> None:
        if self.distributed.enabled:  # a section enabled after it was built
            self.distributed.role = self.distributed.node_role
        if self.data.block_size is None:
            self.data.block_size = self.model.max_seq_len
        if self.data.vocab_size is None:
            self.data.vocab_size = self.model.vocab_size
        if self.data.seed is None:
            self.data.seed = self.run.seed
        if self.run.log_every is not None and self.logging.every_steps == 1:
            self.logging.every_steps = self.run.log_every
        self.sync_scheduler_horizon()
        if self.gradient_checkpointing or self.model.gradient_checkpointing:
            self.gradient_checkpointing = True
            self.model.gradient_checkpointing = True

    # ----------------------------------------------------------------- run target / horizon
    @property
    def effective_max_steps(self) -> int:
        """The absolute optimizer-step target: ``data.max_steps`` if set, else ``run.max_steps``."""
        return self.data.max_steps or self.run.max_steps

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer update (``data.accumulation_steps``)."""
        return self.data.accumulation_steps

    def sync_scheduler_horizon(self) -> SpeedtronicConfig:
        """Set an implicit scheduler horizon to :attr:`effective_max_steps`; returns ``self``."""
        scheduler = self.scheduler
        if not scheduler.max_steps_explicit:
            scheduler.max_steps = self.effective_max_steps
            scheduler.__dict__["_filled_max_steps"] = scheduler.max_steps
        return self

    def apply_run_target(self, max_steps: int) -> SpeedtronicConfig:
        """Change the run target in place (``--max-steps``, ``max_steps=``): ``run.max_steps``,
        ``data.max_steps`` when set, and an implicit scheduler horizon; returns ``self``."""
        max_steps = RunConfig(max_steps=max_steps).max_steps  # validated like the field
        self.run.max_steps = max_steps
        if self.data.max_steps is not None:
            self.data.max_steps = max_steps
        return self.sync_scheduler_horizon()

    def with_max_steps(self, max_steps: int) -> SpeedtronicConfig:
        """A deep copy with :meth:`apply_run_target` applied (``self`` is unchanged)."""
        return copy.deepcopy(self).apply_run_target(max_steps)

    # ----------------------------------------------------------------- validation / paths
    def validate(self) -> SpeedtronicConfig:
        """Cross-section checks (reference/config.md §6.2) and path kinds; returns ``self``."""
        if self.data.block_size is None or self.data.block_size <= 0:
            raise ConfigError("data.block_size must be positive")
        if self.distributed.enabled and not self.distributed.repo_id:
            raise ConfigError("distributed.repo_id is required")
        stall, call = self.metrics.stall_seconds, self.distributed.request_timeout
        if self.distributed.enabled and stall <= call:
            raise ConfigError(
                f"metrics.stall_seconds ({stall:g} s) must exceed distributed.request_timeout "
                f"({call:g} s): a node waiting on one exchange call would be ended as stalled"
            )
        self._check_paths()
        self._check_tokenizer()
        return self

    def _check_tokenizer(self) -> None:
        """``data.tokenizer`` must be readable and fit ``model.vocab_size`` (no torch import);
        with ``model.init_from`` and no vocabulary given, the checkpoint's vocabulary is the
        one to fit, checked when ``init_from`` is resolved (it re-validates)."""
        from speedtronic.config.tokenizer_file import describe_tokenizer, is_bytes

        if is_bytes(self.data.tokenizer):
            return
        info = describe_tokenizer(self.data.tokenizer, token=self.distributed.token)
        unknown = self.model.init_from is not None and "vocab_size" not in self.model.given
        if info.vocab_size > self.model.vocab_size and not unknown:
            padded = -(-info.vocab_size // 64) * 64
            raise ConfigError(
                f"data.tokenizer: {info.spec} has {info.vocab_size} token ids but "
                f"model.vocab_size is {self.model.vocab_size}; set model.vocab_size to at least "
                f"{info.vocab_size} ({padded}, a multiple of 64, runs faster)"
            )

    def _check_paths(self) -> None:
        """An existing path of the wrong kind is a ``ConfigError`` now, not after training
        started. Nothing is created."""
        wanted: list[tuple[str, str | Path | None, str]] = [
            ("run.output_dir", self.output_path, "dir"),
            ("checkpoint.directory", self.checkpoint_dir, "dir"),
            ("distributed.state_dir", self.state_dir, "dir"),
            ("distributed.cache_dir", self.distributed.cache_dir, "dir"),
            ("distributed.slots_dir", self.distributed.slots_dir, "dir"),
            ("logging.file", self.text_log_path, "file"),
            ("logging.json_file", self.events_path, "file"),
            ("data.text_path", self.data.text_path, "file"),
            ("data.token_path", self.data.token_path, "tokens"),
            ("eval.text_path", self.eval.text_path, "file"),
            ("eval.token_path", self.eval.token_path, "tokens"),
        ]
        repo = self.distributed.repo_id or ""
        if repo.startswith("file:///"):
            wanted.append(("distributed.repo_id", repo[len("file://") :], "dir"))
        for field, path, kind in wanted:
            problem = path_kind_problem(path, kind) if path else None
            if problem:
                raise ConfigError(f"{field}: {path} {problem}")

    @property
    def output_path(self) -> Path:
        """``run.output_dir`` as a path (relative to the process working directory)."""
        return Path(self.run.output_dir)

    def resolve_output_path(self, path: str | Path) -> Path:
        """``path`` if absolute, else ``run.output_dir / path``."""
        candidate = Path(path)
        return candidate if candidate.is_absolute() else self.output_path / candidate

    @property
    def checkpoint_dir(self) -> Path:
        """Checkpoint directory: ``checkpoint.directory`` under ``run.output_dir`` if relative."""
        return self.resolve_output_path(self.checkpoint.directory)

    @property
    def text_log_path(self) -> Path | None:
        """Text log file: ``logging.file`` under ``run.output_dir`` if relative; None: stdout."""
        return self.resolve_output_path(self.logging.file) if self.logging.file else None

    @property
    def events_path(self) -> Path | None:
        """JSONL events: ``logging.json_file`` under ``run.output_dir`` if relative; None: off."""
        return self.resolve_output_path(self.logging.json_file) if self.logging.json_file else None

    @property
    def state_dir(self) -> Path:
        """DiLoCo state base (``/<node_id>`` is appended): ``distributed.state_dir`` under
        ``run.output_dir`` if relative."""
        return self.resolve_output_path(self.distributed.state_dir)

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_dict(cls, values: Mapping[str, object] | None = None) -> SpeedtronicConfig:
        """Build from a mapping in any accepted form, 2.0.0 aliases and shorthands included
        (:func:`canonicalize`); never reads the environment."""
        return cls.from_canonical(canonicalize(values))

    @classmethod
    def from_canonical(cls, data: Mapping[str, object]) -> SpeedtronicConfig:
        """Build and validate from a canonical mapping (section names, each a mapping, ``None``
        or a section instance, and root fields); an alias here is an unknown key."""
        unknown = set(data) - set(SECTION_NAMES) - set(ROOT_FIELDS)
        if unknown:
            raise ConfigError(unknown_keys_message(unknown, "", SECTION_NAMES + ROOT_FIELDS))
        # each value is checked by the constructor (a section, or a root field's type)
        kwargs: dict[str, Any] = {
            name: build_section(name, data[name]) for name in SECTION_NAMES if name in data
        }
        kwargs.update({name: data[name] for name in ROOT_FIELDS if name in data})
        return cls(**kwargs).validate()

    @classmethod
    def from_yaml(cls, path: str | Path) -> SpeedtronicConfig:
        """Load a YAML file (malformed YAML or a missing file is a ``ConfigError``)."""
        with with_origin(path):
            return cls.from_dict(read_config_file(path, force_yaml=True))

    @classmethod
    def load(cls, source: object) -> SpeedtronicConfig:
        """A mapping, inline YAML/JSON text, or a path (``.yaml``/``.yml`` else JSON)."""
        inline = isinstance(source, str) and looks_inline(source)
        with with_origin(source if isinstance(source, (str, Path)) and not inline else None):
            return cls.from_dict(read_source(source))

    # ----------------------------------------------------------------- serialisation
    def to_dict(self, *, redact_secrets: bool = False) -> dict[str, Any]:
        """Plain nested dict in field order; ``redact_secrets`` replaces the token wherever its
        value appears (also inside other fields) and anything shaped like a Hub token."""
        token = self.distributed.token
        secrets = ([token] if token else []) if redact_secrets else None
        result = _plain(dataclasses.asdict(self), secrets)
        assert isinstance(result, dict)
        distributed = result["distributed"]
        if redact_secrets and token and isinstance(distributed, dict):
            distributed["token"] = REDACTED
        return result

    def to_yaml(self, *, redact_secrets: bool = False) -> str:
        """Block-style YAML of :meth:`to_dict` (key order preserved)."""
        import yaml

        data = self.to_dict(redact_secrets=redact_secrets)
        text: str = yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
        return text

    def save(self, path: str | Path) -> Path:
        """Write the **redacted** config as YAML (``.yaml``/``.yml``) or JSON; returns the path."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.suffix.lower() in {".yaml", ".yml"}:
            text = self.to_yaml(redact_secrets=True)
        else:
            text = json.dumps(self.to_dict(redact_secrets=True), indent=2) + "\n"
        target.write_text(text, encoding="utf-8")
        return target

    def __repr__(self) -> str:
        inner = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
        token = self.distributed.token
        return scrub(f"SpeedtronicConfig({inner})", [token] if token else [])


Config = SpeedtronicConfig
#: Section name -> its class, in the aggregate's order (the file order of every listing).
SECTION_CLASSES: dict[str, type] = {
    name: info.default_factory
    for name, info in fields_of(SpeedtronicConfig).items()
    if isinstance(info.default_factory, type)
}
assert tuple(SECTION_CLASSES) == SECTION_NAMES


def config_warnings(config: SpeedtronicConfig) -> list[str]:
    """One line per setting that loads but is probably not what was meant: a warmup that
    does not end before the scheduler horizon (allowed, SPEC §3 "Scheduler horizon")."""
    found = []
    warmup, horizon = config.scheduler.warmup_steps, config.scheduler.max_steps
    if warmup and horizon and warmup >= horizon:
        found.append(
            f"scheduler.warmup_steps ({warmup}) >= scheduler.max_steps ({horizon}): the "
            "learning rate never leaves warmup in this run"
        )
    return found
