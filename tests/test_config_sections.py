"""Section validation: every rule and error text of reference/config.md §5, plus SPEC §3 types."""

from __future__ import annotations

import re

import pytest

from speedtronic.config import (
    CheckpointConfig,
    ConfigError,
    DataConfig,
    DistributedConfig,
    LoggingConfig,
    MetricsConfig,
    ModelConfig,
    OptimizerConfig,
    PrecisionConfig,
    RunConfig,
    SchedulerConfig,
    ShapeValidationConfig,
    SpeedtronicConfig,
)


def _error(values: dict) -> str:
    with pytest.raises(ConfigError) as info:
        SpeedtronicConfig.from_dict(values)
    return str(info.value)


RULES = [
    # run
    ({"run": {"max_steps": 0}}, "run.max_steps must be greater than 0"),
    ({"run": {"log_every": 0}}, "run.log_every must be greater than 0"),
    # model
    ({"model": {"max_seq_len": 0}}, "model.max_seq_len must be greater than 0"),
    ({"model": {"vocab_size": -1}}, "model.vocab_size must be greater than 0"),
    ({"model": {"n_layer": 0}}, "model.n_layer must be greater than 0"),
    ({"model": {"n_head": 0}}, "model.n_head must be greater than 0"),
    ({"model": {"n_kv_head": 0}}, "model.n_kv_head must be greater than 0"),
    ({"model": {"d_model": 0}}, "model.d_model must be greater than 0"),
    ({"model": {"d_ff": 0}}, "model.d_ff must be greater than 0"),
    ({"model": {"n_head": 8, "n_kv_head": 3}}, "model.n_head must be divisible by model.n_kv_head"),
    ({"model": {"d_model": 100, "n_head": 8}}, "model.d_model must be divisible by model.n_head"),
    ({"model": {"dropout": 1.0}}, "model.dropout must be less than 1"),
    ({"model": {"dropout": -0.1}}, "model.dropout must be greater than or equal to 0"),
    # data
    ({"data": {"micro_batch_size": 0}}, "data.micro_batch_size must be greater than 0"),
    ({"data": {"target_batch_size": 0}}, "data.target_batch_size must be greater than 0"),
    (
        {"data": {"micro_batch_size": 4, "target_batch_size": 2}},
        "target_batch_size must be >= micro_batch_size",
    ),
    (
        {"data": {"micro_batch_size": 2, "target_batch_size": 3}},
        "target_batch_size must be divisible by micro_batch_size",
    ),
    ({"data": {"vocab_size": 0}}, "data.vocab_size must be greater than 0"),
    ({"data": {"num_tokens": 0}}, "data.num_tokens must be greater than 0"),
    ({"data": {"num_workers": -1}}, "data.num_workers must be greater than or equal to 0"),
    ({"data": {"prefetch_factor": 0}}, "data.prefetch_factor must be greater than 0"),
    ({"data": {"max_steps": 0}}, "data.max_steps must be greater than 0"),
    ({"data": {"block_size": 0}}, "data.block_size must be greater than 0"),
    ({"data": {"token_dtype": "int8"}}, "data.token_dtype must be 'uint16' or 'uint32'"),
    ({"data": {"sampling": "shuffled"}}, "data.sampling must be 'random' or 'sequential'"),
    # optimizer
    ({"optimizer": {"name": "sgd"}}, "optimizer.name must be 'adamw' or 'muon'"),
    ({"optimizer": {"lr": 0}}, "optimizer.lr must be greater than 0"),
    ({"optimizer": {"betas": [0.9]}}, "optimizer.betas[1] is missing"),
    ({"optimizer": {"betas": [0.9, 1.0]}}, "optimizer.betas[1] must be less than 1"),
    ({"optimizer": {"betas": 0.9}}, "optimizer.betas must be a valid tuple"),
    (
        {"optimizer": {"eps": 0}},
        "optimizer.eps must be greater than 0",
    ),
    (
        {"optimizer": {"weight_decay": -0.1}},
        "optimizer.weight_decay must be greater than or equal to 0",
    ),
    ({"optimizer": {"grad_clip": 0}}, "optimizer.grad_clip must be greater than 0"),
    (
        {"optimizer": {"muon_plus": "x"}},
        "optimizer.muon_plus must be a boolean (true/false/yes/no/on/off/1/0)",
    ),
    (
        {"optimizer": {"cautious": 2}},
        "optimizer.cautious must be a boolean (true/false/yes/no/on/off/1/0)",
    ),
    (
        {"optimizer": {"muon_plus": True}},
        "optimizer.muon_plus is only valid with optimizer.name=muon",
    ),
    ({"optimizer": {"muon_momentum": 1.0}}, "optimizer.muon_momentum must be less than 1"),
    ({"optimizer": {"muon_ns_steps": 0}}, "optimizer.muon_ns_steps must be greater than 0"),
    ({"optimizer": {"muon_norm_eps": 0}}, "optimizer.muon_norm_eps must be greater than 0"),
    # scheduler
    ({"scheduler": {"name": "linear"}}, "scheduler.name must be 'cosine' or 'constant'"),
    (
        {"scheduler": {"warmup_steps": -1}},
        "scheduler.warmup_steps must be greater than or equal to 0",
    ),
    ({"scheduler": {"max_steps": 0}}, "scheduler.max_steps must be greater than 0"),
    (
        {"scheduler": {"min_lr_ratio": 1.5}},
        "scheduler.min_lr_ratio must be less than or equal to 1",
    ),
    # precision
    ({"precision": "fp8"}, "precision.mode must be 'auto', 'bf16', 'fp16' or 'fp32'"),
    ({"precision": {"dtype": "auto"}}, "precision.dtype must be 'bf16', 'fp16' or 'fp32'"),
    # checkpoint
    ({"checkpoint": {"every_steps": 0}}, "checkpoint.every_steps must be greater than 0"),
    (
        {"checkpoint": {"enabled": False, "every_steps": 0}},
        "checkpoint.every_steps must be greater than 0",
    ),
    ({"checkpoint": {"keep_last": 0}}, "checkpoint.keep_last must be greater than 0"),
    # logging
    ({"logging": {"every_steps": 0}}, "logging.every_steps must be greater than 0"),
    ({"logging": {"format": "xml"}}, "logging.format must be 'text' or 'json'"),
    (
        {"logging": {"level": "LOUD"}},
        "logging.level must be 'CRITICAL', 'FATAL', 'ERROR', 'WARNING', 'WARN', 'INFO', "
        "'DEBUG' or 'NOTSET'",
    ),
    ({"logging": {"hooks": []}}, "logging: unknown configuration keys: hooks"),
    # metrics
    ({"metrics": {"port": 70000}}, "metrics.port must be less than or equal to 65535"),
    ({"metrics": {"stall_seconds": 0}}, "metrics.stall_seconds must be greater than 0"),
    ({"metrics": {"host": " "}}, "metrics.host must not be empty"),
    # distributed
    ({"distributed": {"mode": "ring"}}, "distributed.mode must be 'dumb_diloco' or 'single'"),
    (
        {"distributed": {"enabled": True, "mode": "single", "repo_id": "a/b"}},
        "distributed.mode must be 'dumb_diloco' when enabled",
    ),
    ({"distributed": {"role": "boss"}}, "distributed.role must be 'single', 'master' or 'worker'"),
    *[
        (
            {"distributed": {"node_id": bad}},
            "distributed.node_id must be a non-empty path-safe identifier",
        )
        for bad in ("", " ", ".", "..", "a/b", "a\\b")
    ],
    (
        {"distributed": {"collaborators": None}},
        "distributed.collaborators must be a list of strings",
    ),
    (
        {"distributed": {"collaborators": ["ok", " "]}},
        "distributed.collaborators must be a list of non-blank strings",
    ),
    (
        {"distributed": {"collaborators": "alice"}},
        "distributed.collaborators must be a list of strings",
    ),
    ({"distributed": {"inner_steps": 0}}, "distributed.inner_steps must be greater than 0"),
    (
        {"distributed": {"poll_interval": 0}},
        "distributed.poll_interval must be greater than or equal to 0.001",
    ),
    ({"distributed": {"outer_lr": 0}}, "distributed.outer_lr must be greater than 0"),
    ({"distributed": {"outer_momentum": 1.0}}, "distributed.outer_momentum must be less than 1"),
    ({"distributed": {"retry_initial": 0}}, "distributed.retry_initial must be greater than 0"),
    (
        {"distributed": {"retry_initial": 5, "retry_max": 1}},
        "distributed retry bounds are invalid",
    ),
    ({"distributed": {"retry_attempts": 0}}, "distributed.retry_attempts must be greater than 0"),
    (
        {"distributed": {"reset_inner_optimizer": "maybe"}},
        "distributed.reset_inner_optimizer must be a boolean",
    ),
    (
        {"distributed": {"async_delta_upload": 3}},
        "distributed.async_delta_upload must be a boolean",
    ),
    (
        {"distributed": {"async_global_poll": []}},
        "distributed.async_global_poll must be a boolean",
    ),
    (
        {"distributed": {"delta_upload_queue_size": 2}},
        "distributed.delta_upload_queue_size is retired: it must be 1 or absent",
    ),
    (
        {"distributed": {"delta_upload_overflow": "block"}},
        "distributed.delta_upload_overflow is retired: it must be skip or absent",
    ),
    (
        {"distributed": {"delta_upload_shutdown_timeout": 0}},
        "distributed.delta_upload_shutdown_timeout must be greater than 0",
    ),
    (
        {"distributed": {"delta_dtype": "fp8"}},
        "distributed.delta_dtype must be 'fp32', 'bf16', 'fp16', 'int8' or 'int4'",
    ),
    (
        {"distributed": {"delta_block_size": 4}},
        "distributed.delta_block_size must be greater than or equal to 8",
    ),
    ({"distributed": {"request_timeout": 0}}, "distributed.request_timeout must be greater than 0"),
    ({"distributed": {"enabled": True}}, "distributed.repo_id is required for DumbDiLoCo"),
    (
        {"distributed": {"repo_id": "file://relative/dir"}},
        "distributed.repo_id must be 'owner/name' (Hub) or 'file:///absolute/path'",
    ),
    # issue 40: timeouts whose order cannot work (docs/diloco.md, "Timeouts")
    (
        {"distributed": {"heartbeat_interval": 5, "liveness_timeout": 10}},
        "distributed.liveness_timeout (10 s) must exceed 2 x distributed.heartbeat_interval",
    ),
    (
        {"distributed": {"min_nodes": 3, "expected_nodes": 2}},
        "distributed.min_nodes (3) exceeds distributed.expected_nodes (2)",
    ),
    (
        {
            "distributed": {"enabled": True, "repo_id": "o/r", "request_timeout": 300},
            "metrics": {"stall_seconds": 300},
        },
        "metrics.stall_seconds (300 s) must exceed distributed.request_timeout (300 s)",
    ),
    ({"run": {"device": " "}}, "run.device must not be empty"),
    # shape validation
    ({"shape_validation": {"enabled": "x"}}, "shape_validation.enabled must be a boolean"),
    (
        {"shape_validation": {"alignment": "8"}},
        "shape_validation.alignment must be 'auto', 'none', or a positive integer",
    ),
    (
        {"shape_validation": {"alignment": True}},
        "shape_validation.alignment must be 'auto' or a positive integer",
    ),
    (
        {"shape_validation": {"alignment": 1.5}},
        "shape_validation.alignment must be 'auto' or a positive integer",
    ),
    ({"shape_validation": {"alignment": 0}}, "shape_validation.alignment must be greater than 0"),
    (
        {"shape_validation": {"alignment": 5000}},
        "shape_validation.alignment must be less than or equal to 4096",
    ),
    *[
        ({"shape_validation": {flag: "x"}}, f"shape_validation.{flag} must be a boolean")
        for flag in ("check_batch", "check_sequence", "check_model", "check_vocab", "warn_on_cpu")
    ],
    # root scalars
    ({"ooo_streams": 0}, "ooo_streams must be greater than or equal to 1"),
    ({"ooo_streams": 9}, "ooo_streams must be less than or equal to 8"),
    ({"ooo_backprop": "sometimes"}, "ooo_backprop must be a boolean"),
]


@pytest.mark.parametrize(("values", "message"), RULES)
def test_every_rule_has_its_text(values: dict, message: str) -> None:
    assert _error(values).startswith(message)


def test_first_failing_check_reports() -> None:
    # one error: the first field in declaration order (vocab_size before max_seq_len)
    assert _error({"model": {"max_seq_len": 0, "vocab_size": 0}}) == (
        "model.vocab_size must be greater than 0, got int 0"
    )
    # sections are built in order run, model, data...: the model's problem is reported (the
    # unset d_ff, derived later from d_model, is not named beside d_model)
    assert _error({"data": {"num_tokens": 0}, "model": {"d_model": 0}}) == (
        "model.d_model must be greater than 0, got int 0"
    )


@pytest.mark.parametrize(
    ("values", "field", "expected"),
    [
        ({"run": {"max_steps": "ten"}}, "run.max_steps", "an integer"),
        ({"run": {"max_steps": True}}, "run.max_steps", "an integer"),
        ({"run": {"max_steps": 2.5}}, "run.max_steps", "an integer"),
        ({"model": {"n_layer": [1]}}, "model.n_layer", "an integer"),
        ({"optimizer": {"lr": "fast"}}, "optimizer.lr", "a number"),
        ({"optimizer": {"lr": "nan"}}, "optimizer.lr", "a finite number"),
        ({"optimizer": {"lr": float("inf")}}, "optimizer.lr", "a finite number"),
        ({"model": {"dropout": {}}}, "model.dropout", "a number"),
        ({"run": {"name": ["x"]}}, "run.name", "a string"),
        ({"run": {"name": True}}, "run.name", "a string"),
        ({"logging": {"level": 10}}, "logging.level", "'NOTSET', got int 10"),
        ({"checkpoint": {"enabled": "maybe"}}, "checkpoint.enabled", "a boolean"),
        ({"data": {"shuffle": 2}}, "data.shuffle", "a boolean"),
        ({"model": {"tie_weights": "nope"}}, "model.tie_weights", "a boolean"),
        ({"distributed": {"enabled": "enabled"}}, "distributed.enabled", "a boolean"),
        ({"data": {"dataset": 5}}, "data.dataset", "a path string or a Dataset"),
        ({"compile": "x"}, "compile", "a boolean"),
        ({"gradient_checkpointing": "x"}, "gradient_checkpointing", "a boolean"),
        ({"ooo_streams": "many"}, "ooo_streams", "an integer"),
    ],
)
def test_wrong_types_are_config_errors_naming_the_field(values, field, expected) -> None:
    message = _error(values)
    assert message.startswith(field)
    assert expected in message


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"run": {"max_steps": None}}, "run.max_steps"),
        ({"run": {"name": None}}, "run.name"),
        ({"model": {"d_model": None}}, "model.d_model"),
        ({"optimizer": {"lr": None}}, "optimizer.lr"),
        ({"optimizer": {"betas": None}}, "optimizer.betas"),
        ({"checkpoint": {"enabled": None}}, "checkpoint.enabled"),
        ({"logging": {"level": None}}, "logging.level"),
        ({"distributed": {"cache_dir": None}}, "distributed.cache_dir"),
        ({"metrics": {"port": None}}, "metrics.port"),
        ({"ooo_streams": None}, "ooo_streams"),
    ],
)
def test_explicit_null_for_non_nullable_field_is_rejected(values, field) -> None:
    message = _error(values)
    assert message.startswith(field)
    assert "null" in message


def test_nullable_fields_accept_null() -> None:
    config = SpeedtronicConfig.from_dict(
        {
            "run": {"log_every": None},
            "model": {"n_kv_head": None, "d_ff": None},
            "data": {"text_path": None, "prefetch_factor": None, "pin_memory": None},
            "optimizer": {"fused": None, "grad_clip": None},
            "scheduler": {"max_steps": None},
            "checkpoint": {"keep_last": None},
            "metrics": {"enabled": None},
            "distributed": {"node_id": None, "token": None},
            "shape_validation": {"alignment": None},
        }
    )
    assert config.model.n_kv_head == config.model.n_head
    assert config.model.d_ff == 4 * config.model.d_model
    assert config.checkpoint.keep_last is None
    assert config.shape_validation.alignment == "auto"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("true", True),
        ("TRUE", True),
        ("Yes", True),
        ("on", True),
        ("1", True),
        ("false", False),
        ("False", False),
        ("no", False),
        ("OFF", False),
        ("0", False),
        (1, True),
        (0, False),
        (True, True),
    ],
)
def test_boolean_strings(text, expected) -> None:
    config = SpeedtronicConfig.from_dict(
        {"checkpoint": {"enabled": text}, "compile": text, "optimizer": {"cautious": text}}
    )
    assert config.checkpoint.enabled is expected
    assert config.compile is expected
    assert config.optimizer.cautious is expected


def test_quoted_false_is_false_everywhere() -> None:
    config = SpeedtronicConfig.load(
        'gradient_checkpointing: "false"\ncompile: {enabled: "false"}\n'
        'model: {gradient_checkpointing: "false", tie_weights: "false"}\n'
        'ooo_backprop: "no"\n'
    )
    assert config.gradient_checkpointing is False
    assert config.model.gradient_checkpointing is False
    assert config.model.tie_weights is False
    assert config.compile is False
    assert config.ooo_backprop is False


def test_exponent_strings_are_floats() -> None:
    config = SpeedtronicConfig.load(
        "optimizer:\n  lr: 3e-4\n  eps: 1e-8\n  betas: ['0.9', 0.95]\n"
        "distributed:\n  poll_interval: '60'\n"
    )
    assert config.optimizer.lr == pytest.approx(3e-4)
    assert config.optimizer.eps == pytest.approx(1e-8)
    assert config.optimizer.betas == (0.9, 0.95)
    assert config.distributed.poll_interval == 60.0


def test_integer_coercions() -> None:
    config = SpeedtronicConfig.from_dict({"run": {"max_steps": "12", "seed": 7.0}})
    assert config.run.max_steps == 12 and isinstance(config.run.max_steps, int)
    assert config.run.seed == 7 and isinstance(config.run.seed, int)


def test_strings_are_normalised() -> None:
    config = SpeedtronicConfig.from_dict(
        {
            "optimizer": {"name": " MUON "},
            "scheduler": {"name": "Constant"},
            "precision": {"mode": "BF16", "dtype": "FP16"},
            "logging": {"level": "debug", "format": "JSON"},
            "distributed": {"mode": "Single", "role": "WORKER", "node_id": " n1 "},
            "data": {"token_dtype": "UINT32", "sampling": "Sequential"},
            "shape_validation": {"alignment": " NONE "},
            "run": {"name": 2024},
        }
    )
    assert config.optimizer.name == "muon"
    assert config.scheduler.name == "constant"
    assert (config.precision.mode, config.precision.dtype) == ("bf16", "fp16")
    assert (config.logging.level, config.logging.format) == ("DEBUG", "json")
    assert (config.distributed.mode, config.distributed.role) == ("single", "worker")
    assert config.distributed.node_id == "n1"
    assert (config.data.token_dtype, config.data.sampling) == ("uint32", "sequential")
    assert config.shape_validation.alignment == "none"
    assert config.run.name == "2024"


def test_role_rewrite_when_enabled() -> None:
    config = SpeedtronicConfig.from_dict({"distributed": {"enabled": True, "repo_id": "a/b"}})
    assert config.distributed.role == "master"
    disabled = SpeedtronicConfig.from_dict({"distributed": {"repo_id": "a/b"}})
    assert disabled.distributed.role == "single"
    # one rule, in one place: what a coordinator built from a disabled section plays
    assert disabled.distributed.node_role == "master"
    assert DistributedConfig().node_role == "worker"
    assert DistributedConfig(role="worker", repo_id="a/b").node_role == "worker"
    section = DistributedConfig(repo_id="a/b")
    section.enabled = True  # enabled after it was built: the aggregate applies the rule
    assert SpeedtronicConfig(distributed=section).distributed.role == "master"


def test_new_fields_defaults() -> None:
    config = SpeedtronicConfig()
    assert config.metrics == MetricsConfig(enabled=None, host="0.0.0.0", port=8000)
    assert config.metrics.stall_seconds == 300.0
    assert config.logging.format == "text"
    assert config.data.token_path is None
    assert config.data.token_dtype == "uint16"
    assert config.data.sampling == "random"
    assert config.data.allow_pickle is False
    assert config.run.stop_on_nonfinite is True
    assert config.checkpoint.save_final is True
    assert config.distributed.delta_dtype == "fp32"
    assert config.distributed.delta_block_size == 128
    assert config.distributed.request_timeout == 60.0


def test_direct_construction_validates() -> None:
    with pytest.raises(
        ConfigError, match=re.escape("run.max_steps must be greater than 0, got int 0")
    ):
        RunConfig(max_steps=0)
    with pytest.raises(ConfigError, match=r"model\.d_model must be divisible"):
        ModelConfig(d_model=10, n_head=3, n_kv_head=1)
    with pytest.raises(ConfigError):
        DataConfig(micro_batch_size=3, target_batch_size=4)
    with pytest.raises(ConfigError):
        OptimizerConfig(lr=-1)
    with pytest.raises(ConfigError):
        SchedulerConfig(warmup_steps=-1)
    with pytest.raises(ConfigError):
        PrecisionConfig(mode="int8")
    with pytest.raises(ConfigError):
        CheckpointConfig(keep_last=-1)
    with pytest.raises(ConfigError):
        LoggingConfig(every_steps=0)
    with pytest.raises(ConfigError):
        DistributedConfig(inner_steps=0)
    with pytest.raises(ConfigError):
        ShapeValidationConfig(alignment=-8)
    assert isinstance(ConfigError("x"), ValueError)


def test_mutation_is_not_revalidated() -> None:
    config = SpeedtronicConfig()
    config.run.max_steps = -5
    assert config.run.max_steps == -5
    config.data.block_size = 0
    with pytest.raises(ConfigError, match=r"^data.block_size must be positive$"):
        config.validate()
    config = SpeedtronicConfig()
    config.distributed.enabled = True
    with pytest.raises(ConfigError, match=r"^distributed.repo_id is required$"):
        config.validate()


def test_accumulation_steps() -> None:
    config = SpeedtronicConfig.from_dict({"data": {"micro_batch_size": 2, "target_batch_size": 8}})
    assert config.data.accumulation_steps == 4
    assert config.accumulation_steps == 4


def test_token_never_in_repr_or_errors() -> None:
    config = SpeedtronicConfig.from_dict({"distributed": {"token": "hf_secret_value"}})
    assert "hf_secret_value" not in repr(config)
    assert "hf_secret_value" not in repr(config.distributed)
    message = _error({"distributed": {"token": ["hf_secret_value"]}})
    assert message.startswith("distributed.token must be a string")
    assert "hf_secret_value" not in message


def test_oversized_numbers_and_odd_objects_are_config_errors() -> None:
    assert _error({"optimizer": {"lr": 10**400}}).startswith("optimizer.lr must be a number")
    assert _error({"run": {"max_steps": "9" * 5000}}).startswith("run.max_steps must be")
    import datetime

    assert _error({"data": {"dataset": datetime.date(2024, 1, 1)}}).startswith("data.dataset")
    assert _error({"data": {"dataset": {"a": 1}}}).startswith("data.dataset")
