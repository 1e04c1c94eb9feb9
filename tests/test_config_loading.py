"""Loading forms, aliases, normalisation, scheduler horizon, serialisation, shipped configs."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from speedtronic.config import (
    Config,
    ConfigError,
    DistributedConfig,
    OptimizerConfig,
    RunConfig,
    SchedulerConfig,
    SpeedtronicConfig,
    load_config,
    load_yaml_config,
)

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


# --------------------------------------------------------------------------- accepted forms
def test_from_dict_none_and_empty_are_defaults() -> None:
    assert SpeedtronicConfig.from_dict(None).to_dict() == SpeedtronicConfig().to_dict()
    assert SpeedtronicConfig.from_dict({}).to_dict() == SpeedtronicConfig().to_dict()
    assert Config is SpeedtronicConfig


@pytest.mark.parametrize("root", [[1, 2], "text", 3])
def test_root_must_be_a_mapping(root) -> None:
    with pytest.raises(ConfigError, match=r"^configuration root must be a mapping$"):
        SpeedtronicConfig.from_dict(root)


def test_from_canonical_does_not_normalise_again() -> None:
    """issue 11: from_dict normalises 2.0.0 forms once; from_canonical takes canonical data only."""
    canonical = {"run": {"max_steps": 3}, "optimizer": {"name": "muon"}, "compile": True}
    built = SpeedtronicConfig.from_canonical(canonical)
    assert built.to_dict() == SpeedtronicConfig.from_dict(canonical).to_dict()
    assert SpeedtronicConfig.from_dict({"max_steps": 3}).run.max_steps == 3
    with pytest.raises(ConfigError, match="unknown configuration keys: max_steps"):
        SpeedtronicConfig.from_canonical({"max_steps": 3})
    with pytest.raises(ConfigError, match="unknown configuration keys: hub"):
        SpeedtronicConfig.from_canonical({"hub": {"inner_steps": 3}})
    with pytest.raises(ConfigError, match="optimizer must be a mapping"):
        SpeedtronicConfig.from_canonical({"optimizer": "muon"})
    with pytest.raises(ConfigError, match="compile must be a boolean"):
        SpeedtronicConfig.from_canonical({"compile": {"enabled": True}})


def test_from_dict_does_not_mutate_input() -> None:
    values = {"max_steps": 5, "run": {"name": "a"}, "optimizer": "muon", "muon_plus": True}
    snapshot = json.dumps(values)
    SpeedtronicConfig.from_dict(values)
    assert json.dumps(values) == snapshot


@pytest.mark.parametrize("section", ["model", "data", "optimizer", "logging", "distributed"])
def test_section_must_be_a_mapping(section) -> None:
    with pytest.raises(ConfigError, match=f"^{section} must be a mapping"):
        SpeedtronicConfig.from_dict({section: [1]})


def test_section_none_means_defaults_and_instances_are_used() -> None:
    run = RunConfig(name="x")
    config = SpeedtronicConfig.from_dict({"model": None, "run": run})
    assert config.model == SpeedtronicConfig().model
    assert config.run.name == "x"


def test_unknown_keys() -> None:
    with pytest.raises(ConfigError, match=r"^unknown configuration keys: a, zeta$"):
        SpeedtronicConfig.from_dict({"zeta": 1, "a": 2})
    with pytest.raises(ConfigError, match=r"^model: unknown configuration keys: bar, foo$"):
        SpeedtronicConfig.from_dict({"model": {"foo": 1, "bar": 2}})
    with pytest.raises(ConfigError, match=r"^compile: unknown configuration keys: mode$"):
        SpeedtronicConfig.from_dict({"compile": {"enabled": True, "mode": "max"}})


def test_load_heuristics(tmp_path, monkeypatch) -> None:
    assert load_config("name: demo\nmax_steps: 10").run.max_steps == 10
    assert load_config("name: demo").run.name == "demo"
    assert load_config('{"max_steps": 3}').run.max_steps == 3
    assert load_config({"max_steps": 2}).run.max_steps == 2
    with pytest.raises(ConfigError, match="configuration root must be a mapping"):
        load_config("C:\\no\\such\\file.yaml")
    with pytest.raises(FileNotFoundError):
        load_config(str(tmp_path / "missing.yaml"))
    json_path = tmp_path / "run.json"
    json_path.write_text('{"max_steps": 6}')
    assert load_config(json_path).run.max_steps == 6
    txt_path = tmp_path / "run.txt"
    txt_path.write_text('{"max_steps": 8}')
    assert load_config(str(txt_path)).run.max_steps == 8
    yml = tmp_path / "run.YML"
    yml.write_text("max_steps: 9\n")
    assert load_config(yml).run.max_steps == 9
    assert load_yaml_config(yml).run.max_steps == 9
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{nope")
    with pytest.raises(ConfigError, match="invalid JSON at line 1, column 2"):
        load_config(bad_json)


@pytest.mark.parametrize("content", ["", "null", "false", "0", "{}"])
def test_falsy_yaml_documents_are_defaults(tmp_path, content) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text(content)
    assert SpeedtronicConfig.from_yaml(path).to_dict() == SpeedtronicConfig().to_dict()


def test_missing_file_is_config_error_and_file_not_found(tmp_path) -> None:
    with pytest.raises(ConfigError, match="config file not found") as info:
        SpeedtronicConfig.from_yaml(tmp_path / "nope.yaml")
    assert isinstance(info.value, FileNotFoundError)


def test_malformed_yaml_names_line_and_column(tmp_path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("run:\n  max_steps: 4\n  name: [unclosed\nmodel: {}\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: invalid YAML at line \d+, column \d+"):
        SpeedtronicConfig.from_yaml(path)
    with pytest.raises(ConfigError, match=r"invalid YAML at line 2, column"):
        load_config("a: 1\n\tb: 2\n")


def test_directory_path_is_config_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match="directory"):
        load_config(str(tmp_path))


# --------------------------------------------------------------------------- aliases
def test_run_aliases_overwrite_nested_run() -> None:
    config = SpeedtronicConfig.from_dict(
        {
            "name": "root",
            "seed": 1,
            "device": "cpu",
            "output_dir": "out",
            "max_steps": 5,
            "log_every": 3,
            "run": {"name": "nested", "seed": 9},
        }
    )
    run = config.run
    assert (run.name, run.seed, run.device, run.output_dir, run.max_steps, run.log_every) == (
        "root",
        1,
        "cpu",
        "out",
        5,
        3,
    )


def test_run_must_be_mapping() -> None:
    with pytest.raises(ConfigError, match=r"^run must be a mapping$"):
        SpeedtronicConfig.from_dict({"run": 5})


def test_hub_and_diloco_aliases() -> None:
    hub = SpeedtronicConfig.from_dict({"hub": {"inner_steps": 7}})
    assert hub.distributed.inner_steps == 7
    diloco = SpeedtronicConfig.from_dict({"diloco": {"inner_steps": 8}})
    assert diloco.distributed.inner_steps == 8
    with pytest.raises(ConfigError, match=r"^unknown configuration keys: hub$"):
        SpeedtronicConfig.from_dict({"hub": {}, "distributed": {}})
    with pytest.raises(ConfigError, match=r"^unknown configuration keys: diloco$"):
        SpeedtronicConfig.from_dict({"hub": {}, "diloco": {}})


def test_optimizer_shorthands_and_conflicts() -> None:
    config = SpeedtronicConfig.from_dict({"optimizer": "Muon", "muon_plus": True, "cautious": True})
    assert (config.optimizer.name, config.optimizer.muon_plus, config.optimizer.cautious) == (
        "muon",
        True,
        True,
    )
    same = SpeedtronicConfig.from_dict({"optimizer": {"cautious": True}, "cautious": True})
    assert same.optimizer.cautious is True
    with pytest.raises(ConfigError, match=r"^conflicting optimizer.muon_plus values$"):
        SpeedtronicConfig.from_dict(
            {"optimizer": {"name": "muon", "muon_plus": False}, "muon_plus": True}
        )
    with pytest.raises(ConfigError, match=r"^conflicting optimizer.cautious values$"):
        SpeedtronicConfig.from_dict({"optimizer": {"cautious": True}, "cautious": False})
    with pytest.raises(
        ConfigError, match=r"^optimizer must be a mapping or optimizer name string$"
    ):
        SpeedtronicConfig.from_dict({"optimizer": 5, "cautious": True})
    instance = SpeedtronicConfig.from_dict(
        {"optimizer": OptimizerConfig(lr=0.01, cautious=True), "cautious": True}
    )
    assert instance.optimizer.lr == 0.01 and instance.optimizer.cautious is True


def test_precision_and_compile_forms() -> None:
    assert SpeedtronicConfig.from_dict({"precision": "BF16"}).precision.mode == "bf16"
    assert SpeedtronicConfig.from_dict({"compile": {"enabled": True}}).compile is True
    assert SpeedtronicConfig.from_dict({"compile": {}}).compile is False
    assert SpeedtronicConfig.from_dict({"compile": "yes"}).to_dict()["compile"] is True


# --------------------------------------------------------------------------- normalisation
def test_normalisation_fills_data_and_logging() -> None:
    config = SpeedtronicConfig.from_dict(
        {"seed": 7, "log_every": 5, "model": {"max_seq_len": 64, "vocab_size": 99}}
    )
    assert config.data.block_size == 64
    assert config.data.vocab_size == 99
    assert config.data.seed == 7
    assert config.logging.every_steps == 5
    explicit = SpeedtronicConfig.from_dict({"log_every": 5, "logging": {"every_steps": 2}})
    assert explicit.logging.every_steps == 2


def test_gradient_checkpointing_flags_are_or_synchronised() -> None:
    root = SpeedtronicConfig.from_dict({"gradient_checkpointing": True})
    assert root.model.gradient_checkpointing is True
    model = SpeedtronicConfig.from_dict({"model": {"gradient_checkpointing": "on"}})
    assert model.gradient_checkpointing is True


def test_role_rewrite_runs_before_data_fill() -> None:
    config = SpeedtronicConfig(
        distributed=DistributedConfig(repo_id="a/b"),
    )
    config.distributed.enabled = True
    rebuilt = SpeedtronicConfig(distributed=config.distributed)
    assert rebuilt.distributed.role == "master"


# --------------------------------------------------------------------------- scheduler horizon
def test_horizon_follows_run_target_when_not_explicit() -> None:
    config = load_config({"max_steps": 10})
    assert config.scheduler.max_steps == 10
    assert config.scheduler.warmup_steps == 100  # warmup >= horizon is allowed
    assert config.scheduler.max_steps_explicit is False
    assert load_config({"max_steps": 5000}).scheduler.max_steps == 5000
    assert SpeedtronicConfig().scheduler.max_steps == 1000


def test_horizon_follows_data_max_steps() -> None:
    config = load_config({"max_steps": 10, "data": {"max_steps": 50}})
    assert config.effective_max_steps == 50
    assert config.scheduler.max_steps == 50


def test_explicit_horizon_is_kept() -> None:
    config = load_config({"max_steps": 10, "scheduler": {"max_steps": 1000}})
    assert config.scheduler.max_steps == 1000
    config.apply_run_target(3)
    assert config.run.max_steps == 3
    assert config.scheduler.max_steps == 1000


def test_apply_run_target_moves_implicit_horizon() -> None:
    config = load_config({"max_steps": 10})
    assert config.apply_run_target(25) is config
    assert (config.run.max_steps, config.scheduler.max_steps) == (25, 25)
    data = load_config({"data": {"max_steps": 50}})
    data.apply_run_target(7)
    assert (data.effective_max_steps, data.scheduler.max_steps) == (7, 7)
    with pytest.raises(ConfigError):
        config.apply_run_target(0)


def test_with_max_steps_returns_copy() -> None:
    config = load_config({"max_steps": 10})
    other = config.with_max_steps(4)
    assert (other.run.max_steps, other.scheduler.max_steps) == (4, 4)
    assert (config.run.max_steps, config.scheduler.max_steps) == (10, 10)


def test_sync_after_mutation_and_assigned_horizon_counts_as_explicit() -> None:
    config = load_config({"max_steps": 10})
    config.run.max_steps = 30
    config.sync_scheduler_horizon()
    assert config.scheduler.max_steps == 30
    config.scheduler.max_steps = 99
    config.apply_run_target(12)
    assert config.scheduler.max_steps == 99


def test_scheduler_section_alone_defaults_to_follow() -> None:
    assert SchedulerConfig().max_steps is None
    config = SpeedtronicConfig(run=RunConfig(max_steps=8), scheduler=SchedulerConfig())
    assert config.scheduler.max_steps == 8


# --------------------------------------------------------------------------- serialisation
def test_to_dict_order_and_types() -> None:
    data = SpeedtronicConfig().to_dict()
    assert list(data) == [
        "run",
        "model",
        "data",
        "optimizer",
        "scheduler",
        "precision",
        "checkpoint",
        "logging",
        "distributed",
        "shape_validation",
        "metrics",
        "eval",
        "runtime",
        "gradient_checkpointing",
        "compile",
        "ooo_backprop",
        "ooo_streams",
    ]
    assert data["optimizer"]["betas"] == [0.9, 0.95]
    assert "1.0e-08" in SpeedtronicConfig().to_yaml()


def test_redaction() -> None:
    config = SpeedtronicConfig.from_dict({"distributed": {"token": "hf_abc"}})
    assert config.to_dict()["distributed"]["token"] == "hf_abc"
    assert config.to_dict(redact_secrets=True)["distributed"]["token"] == "<redacted>"
    assert "hf_abc" not in config.to_yaml(redact_secrets=True)
    assert "<redacted>" in config.to_yaml(redact_secrets=True)
    empty = SpeedtronicConfig.from_dict({"distributed": {"token": ""}})
    assert empty.to_dict(redact_secrets=True)["distributed"]["token"] == ""


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".json"])
def test_round_trip(tmp_path, suffix) -> None:
    config = load_config(
        {
            "name": "rt",
            "max_steps": 12,
            "optimizer": {"name": "muon", "muon_plus": True, "lr": "3e-4"},
            "distributed": {"enabled": True, "repo_id": "file:///tmp/x", "collaborators": ["a"]},
            "metrics": {"enabled": True, "port": 9100},
            "data": {"token_path": "t.bin", "sampling": "sequential"},
        }
    )
    path = config.save(tmp_path / "sub" / f"run{suffix}")
    assert path.exists()
    assert load_config(path).to_dict() == config.to_dict()


def test_saved_file_has_no_token(tmp_path) -> None:
    config = SpeedtronicConfig.from_dict({"distributed": {"token": "hf_secret_token"}})
    for name in ("a.yaml", "a.json"):
        path = config.save(tmp_path / name)
        text = path.read_text()
        assert "hf_secret_token" not in text
        assert "<redacted>" in text
        reloaded = load_config(path)
        assert reloaded.to_dict(redact_secrets=True) == config.to_dict(redact_secrets=True)


def test_token_in_yaml_is_warned(tmp_path, caplog) -> None:
    path = tmp_path / "tok.yaml"
    path.write_text("distributed:\n  token: hf_in_file\n")
    with caplog.at_level(logging.WARNING, logger="speedtronic.config"):
        config = load_config(path)
    assert config.distributed.token == "hf_in_file"
    assert any("token" in record.getMessage() for record in caplog.records)
    assert all("hf_in_file" not in record.getMessage() for record in caplog.records)


def test_paths() -> None:
    config = load_config({"output_dir": "out", "checkpoint": {"directory": "ck"}})
    assert config.checkpoint_dir == Path("out/ck")
    assert config.state_dir == Path("out/.speedtronic/diloco")
    assert config.resolve_output_path("/abs/x") == Path("/abs/x")
    absolute = load_config({"checkpoint": {"directory": "/abs/ck"}})
    assert absolute.checkpoint_dir == Path("/abs/ck")


# --------------------------------------------------------------------------- shipped files
@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_loads(path) -> None:
    config = load_yaml_config(path)
    assert config.to_dict(redact_secrets=True)["distributed"]["token"] is None
    assert load_config(config.to_dict()).to_dict() == config.to_dict()


def test_shipped_set() -> None:
    names = {p.name for p in CONFIGS}
    assert {"smoke.yaml", "diloco.yaml", "hub.yaml", "gpt2-124m.yaml"} <= names


def test_smoke_values() -> None:
    config = load_yaml_config(REPO / "configs" / "smoke.yaml")
    model = config.model
    assert (model.n_layer, model.d_model, model.n_head, model.n_kv_head) == (2, 64, 4, 2)
    assert (model.vocab_size, model.max_seq_len, model.d_ff) == (128, 32, 128)
    assert (config.run.max_steps, config.scheduler.max_steps) == (200, 200)
    assert config.scheduler.max_steps_explicit is False
    assert config.precision.mode == "fp32"
    assert config.checkpoint.every_steps == 100
    assert config.data.synthetic == "markov" and config.eval.holdout == 0.1
    assert config.accumulation_steps == 2
    assert config.run.output_dir == "runs/smoke"
    assert config.logging.json_file == "events.jsonl"  # under output_dir
    assert config.events_path == Path("runs/smoke/events.jsonl")


def test_transports_in_shipped_configs() -> None:
    diloco = load_yaml_config(REPO / "configs" / "diloco.yaml")
    assert diloco.distributed.enabled and diloco.distributed.repo_id.startswith("file:///")
    hub = load_yaml_config(REPO / "configs" / "hub.yaml")
    assert hub.distributed.repo_id == "your-org/speedtronic-run"
    assert "token" not in yaml.safe_load((REPO / "configs" / "hub.yaml").read_text())["distributed"]
    gpt2 = load_yaml_config(REPO / "configs" / "gpt2-124m.yaml")
    assert (gpt2.model.n_layer, gpt2.model.d_model, gpt2.model.n_head) == (12, 768, 12)
    assert (gpt2.model.vocab_size, gpt2.model.max_seq_len, gpt2.precision.mode) == (
        50304,
        1024,
        "bf16",
    )


# --------------------------------------------------------------------------- frozen key set
FROZEN_KEYS = {
    "run": "name seed device max_steps output_dir log_every stop_on_nonfinite nproc_per_node "
    "data_parallel collective_timeout push_to_hub",
    "model": "name init_from vocab_size max_seq_len n_layer n_head n_kv_head d_model d_ff dropout "
    "tie_weights rope_base norm_eps gradient_checkpointing",
    "data": "text_path dataset synthetic num_tokens vocab_size block_size micro_batch_size "
    "target_batch_size num_workers prefetch_factor pin_memory shuffle drop_last seed max_steps "
    "token_path token_dtype sampling allow_pickle tokenizer",
    "optimizer": "name lr betas eps weight_decay fused grad_clip muon_plus cautious "
    "muon_momentum muon_ns_steps muon_norm_eps muon_ns_dtype",
    "scheduler": "name warmup_steps max_steps min_lr_ratio",
    "precision": "mode dtype",
    "checkpoint": "enabled directory every_steps keep_last resume overwrite save_final",
    "logging": "level file every_steps json_file format trackers project run_name",
    "distributed": "enabled mode role node_id collaborators inner_steps poll_interval sync "
    "overlap_steps fragments "
    "round_timeout min_nodes expected_nodes max_staleness drop_after heartbeat_interval "
    "liveness_timeout train relay_to "
    "relay_leaders outer_step outer_lr outer_momentum adaptive_c adaptive_max final_average "
    "sync_inner_momentum inner_momentum_every "
    "repo_id token cache_dir state_dir retry_initial retry_max retry_attempts "
    "reset_inner_optimizer async_delta_upload "
    "delta_upload_shutdown_timeout async_global_poll delta_dtype delta_block_size error_feedback "
    "global_dtype request_timeout slots_dir",
    "shape_validation": "enabled alignment check_batch check_sequence check_model check_vocab "
    "warn_on_cpu",
    "metrics": "enabled host port stall_seconds",
    "eval": "text_path token_path holdout every_steps tokens batch_size",
    "runtime": "threads",
}


def test_config_keys_are_frozen() -> None:
    """Adding or renaming a field must be deliberate: update this list and the docs."""
    data = SpeedtronicConfig().to_dict()
    sections = {key: value for key, value in data.items() if isinstance(value, dict)}
    assert {key: list(value) for key, value in sections.items()} == {
        key: value.split() for key, value in FROZEN_KEYS.items()
    }
    roots = [key for key, value in data.items() if not isinstance(value, dict)]
    assert roots == ["gradient_checkpointing", "compile", "ooo_backprop", "ooo_streams"]


def test_docs_mention_every_field() -> None:
    docs = (REPO / "docs" / "configuration.md").read_text()
    for section, names in FROZEN_KEYS.items():
        for name in names.split():
            assert f"`{name}`" in docs or f"{section}.{name}" in docs, f"{section}.{name}"


# --------------------------------------------------------------------------- import hygiene
def test_import_config_does_not_import_torch_or_read_env() -> None:
    code = (
        "import sys, speedtronic.config as c\n"
        "c.load_config({'max_steps': 3})\n"
        "c.resolve_config({'max_steps': 3}, environ={}, secrets_dir='/nonexistent')\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "from speedtronic import MetricsConfig, SpeedtronicConfig, ConfigError\n"
        "assert 'torch' not in sys.modules\n"
    )
    env = {"PATH": "/usr/bin:/bin", "SPEEDTRONIC_BOGUS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
