"""Issue 39: what arrives with a checkpoint is data, never an instruction.

Item 1: the config a checkpoint carries (a ``.pt``'s ``config`` entry, a ``final/`` folder's
``config.yaml``) cannot switch on pickle loading, a remote ``init_from``, a push or a tracker:
``eval``/``sample``/``export``/``push --checkpoint X`` without ``--config`` set those back to
their defaults and say so in one line. Only the user's own layers (``--config``, secret
files, the environment, ``--set``) can set them.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
import yaml

from speedtronic.checkpoint import checkpoint_config
from speedtronic.cli import main
from speedtronic.config import SpeedtronicConfig
from speedtronic.model import build_model

MODEL = {"vocab_size": 64, "max_seq_len": 16, "n_layer": 1, "n_head": 2, "d_model": 32}


class _Opens:
    """Unpickling this calls ``open(path, "w")``: the file appears only if code ran."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _hostile_values(tmp_path: Path) -> dict:
    """A run config that asks for a pickled dataset whose unpickling creates ``marker``."""
    dataset = tmp_path / "dataset.pt"
    torch.save({"input_ids": _Opens(tmp_path / "marker")}, dataset, pickle_protocol=2)
    return {
        "run": {"device": "cpu", "push_to_hub": "attacker/loot"},
        "model": dict(MODEL, init_from="attacker/model"),
        "data": {"dataset": str(dataset), "allow_pickle": True},
        "logging": {"trackers": ["tensorboard"]},
        "eval": {"holdout": 0.5, "tokens": 64},
    }


@pytest.fixture(autouse=True)
def _no_user_config(monkeypatch, tmp_path):
    monkeypatch.delenv("SPEEDTRONIC_CONFIG", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("SPEEDTRONIC_SECRETS_DIR", str(tmp_path / "no-secrets"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a remote init_from must not be tried at all


def _weights() -> dict:
    return {
        k: v.clone()
        for k, v in build_model(SpeedtronicConfig.from_dict({"model": MODEL}).model)
        .state_dict()
        .items()
    }


def _pt_checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "step_000000000001.pt"
    torch.save({"model": _weights(), "step": 1, "config": _hostile_values(tmp_path)}, path)
    return path


def _final_folder(tmp_path: Path) -> Path:
    from safetensors.torch import save_file

    final = tmp_path / "final"
    final.mkdir()
    save_file(_weights(), str(final / "model.safetensors"))
    (final / "config.yaml").write_text(yaml.safe_dump(_hostile_values(tmp_path)))
    return final


@pytest.mark.parametrize("make", [_pt_checkpoint, _final_folder], ids=["pt", "final"])
def test_eval_from_a_checkpoint_never_unpickles_what_its_config_names(make, tmp_path, capsys):
    checkpoint = make(tmp_path)
    assert pickle.loads(pickle.dumps(_Opens(tmp_path / "probe"))) and (tmp_path / "probe").exists()
    code = main(["eval", "--checkpoint", str(checkpoint)])
    err = capsys.readouterr().err
    assert not (tmp_path / "marker").exists(), "the checkpoint's config ran code"
    assert code == 2, err
    said = [line for line in err.splitlines() if "ignored" in line]
    assert len(said) == 1, err
    for field in ("data.allow_pickle", "model.init_from", "run.push_to_hub", "logging.trackers"):
        assert field in said[0]
    assert "allow_pickle" in err.splitlines()[-1]  # the dataset is refused as pickled


def test_the_user_can_still_opt_in_on_the_command_line(tmp_path, capsys):
    checkpoint = _pt_checkpoint(tmp_path)
    main(["eval", "--checkpoint", str(checkpoint), "--set", "data.allow_pickle=true"])
    capsys.readouterr()
    assert (tmp_path / "marker").exists()  # the user's own layer may (and it did run)


def test_checkpoint_config_drops_what_only_the_user_may_set(tmp_path):
    values = checkpoint_config(_pt_checkpoint(tmp_path))
    assert "allow_pickle" not in values["data"] and "init_from" not in values["model"]
    assert "push_to_hub" not in values["run"] and "trackers" not in values["logging"]
    assert values["data"]["dataset"] == str(tmp_path / "dataset.pt")  # a path stays data
    assert values["model"]["d_model"] == 32


# ---------------------------------------------------------------------------------------------
# Item 5: sizes are checked before they are built. Item 16: NaN weights are refused at load.

HUGE = {"vocab_size": 2**20, "d_model": 8192}  # 34 GB of embedding alone, declared in 0.8 MB


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _plain_checkpoint(tmp_path: Path, *, model: dict | None = None, nan: bool = False) -> Path:
    weights = _weights()
    if nan:
        weights["transformer.ln_f.weight"][3] = float("nan")
    values = {"run": {"device": "cpu"}, "model": model or MODEL, "eval": {"holdout": 0.5}}
    path = tmp_path / "step_000000000002.pt"
    torch.save({"model": weights, "step": 2, "config": values}, path)
    return path


def test_a_checkpoint_declaring_a_huge_model_allocates_nothing(tmp_path, capsys):
    checkpoint = _plain_checkpoint(tmp_path, model=dict(MODEL, **HUGE))
    assert checkpoint.stat().st_size < 1_000_000
    before = _peak_rss_mb()
    for command in (["eval"], ["sample", "--prompt", "a"], ["export", "-o", str(tmp_path / "hf")]):
        code = main([*command, "--checkpoint", str(checkpoint)])
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(lines) == 1, (command, lines)
        assert str(checkpoint) in lines[0] and "transformer.wte.weight" in lines[0]
        assert "model.vocab_size 1048576" in lines[0] and "model.d_model 8192" in lines[0]
    assert _peak_rss_mb() - before < 200  # the 34 GB model was never built
    assert not (tmp_path / "hf").exists()


def _llama_folder(folder: Path, *, declared: dict | None = None, nan: bool = False) -> Path:
    """A transformers-layout folder of the MODEL shape (``config.json`` + safetensors), written
    from the reference model through the exporter's name table; ``declared`` overrides what
    ``config.json`` says."""
    from safetensors.torch import save_file

    from speedtronic.model.export import llama_names

    names = llama_names(MODEL["n_layer"], True)
    tensors = {names[k]: v.contiguous() for k, v in _weights().items() if k in names}
    if nan:
        tensors["model.layers.0.mlp.up_proj.weight"][0, 0] = float("inf")
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    width = tensors["model.layers.0.mlp.gate_proj.weight"].shape[0]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": MODEL["vocab_size"],
        "hidden_size": MODEL["d_model"],
        "intermediate_size": width,
        "num_hidden_layers": MODEL["n_layer"],
        "num_attention_heads": MODEL["n_head"],
        "num_key_value_heads": MODEL["n_head"],
        "max_position_embeddings": MODEL["max_seq_len"],
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        **(declared or {}),
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _init_config(tmp_path: Path, folder: Path) -> Path:
    values = {
        "run": {"device": "cpu", "max_steps": 2, "output_dir": str(tmp_path / "run")},
        "model": {"init_from": str(folder)},
        "data": {"num_tokens": 64, "block_size": 16, "micro_batch_size": 2, "target_batch_size": 2},
        "scheduler": {"warmup_steps": 1},
        "logging": {"level": "WARNING"},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


@pytest.mark.parametrize("weights", ["16 bytes", "a smaller model"])
def test_init_from_declaring_a_huge_model_is_refused_by_validate_and_train(
    tmp_path, capsys, weights
):
    huge = {"vocab_size": HUGE["vocab_size"], "hidden_size": HUGE["d_model"]}
    folder = _llama_folder(tmp_path / "llama", declared=huge)
    if weights == "16 bytes":
        (folder / "model.safetensors").write_bytes(b"\x08" + bytes(15))
    config = _init_config(tmp_path, folder)
    before = _peak_rss_mb()
    for command in ("validate", "train"):
        code = main([command, "--config", str(config)])
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(lines) == 1, (command, lines)
        assert lines[0].startswith("error: model.init_from") and "model.safetensors" in lines[0]
        if weights != "16 bytes":
            assert "model.vocab_size 1048576" in lines[0] and "model.d_model 8192" in lines[0]
    assert _peak_rss_mb() - before < 200
    assert not (tmp_path / "run").exists()


def test_a_model_larger_than_memory_is_refused_before_it_is_built(tmp_path):
    from speedtronic.config import ConfigError, ModelConfig
    from speedtronic.model.sizes import check_memory, memory_limit

    section = ModelConfig(**MODEL)
    size = check_memory(section, "the config", limit=10**9)
    with pytest.raises(
        ConfigError, match=r"model: x\.yaml declares a model of .* MB \(model\.d_model 32"
    ):
        check_memory(section, "x.yaml", limit=size - 1)
    root = tmp_path / "root"
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text("4:memory:/job\n0::/pod\n")
    (root / "sys/fs/cgroup/memory/job").mkdir(parents=True)
    (root / "sys/fs/cgroup/memory/job/memory.limit_in_bytes").write_text("5000000\n")
    (root / "sys/fs/cgroup/pod").mkdir(parents=True)
    (root / "sys/fs/cgroup/pod/memory.max").write_text("max\n")
    assert memory_limit(root) == 5_000_000


def test_nan_weights_in_a_checkpoint_are_refused_at_load(tmp_path, capsys):
    checkpoint = _plain_checkpoint(tmp_path, nan=True)
    code = main(["eval", "--checkpoint", str(checkpoint)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert str(checkpoint) in lines[0] and "transformer.ln_f.weight holds NaN" in lines[0]


def test_a_resume_skips_a_checkpoint_with_nan_weights(tmp_path, capsys):
    values = {
        "run": {"device": "cpu", "max_steps": 4, "output_dir": str(tmp_path / "run")},
        "model": MODEL,
        "data": {"num_tokens": 256, "micro_batch_size": 2, "target_batch_size": 2},
        "scheduler": {"warmup_steps": 1},
        "checkpoint": {"every_steps": 2, "keep_last": 5},
        "logging": {"level": "WARNING"},
    }
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(values))
    assert main(["train", "--config", str(config)]) == 0
    newest = tmp_path / "run" / "checkpoints" / "step_000000000004.pt"
    state = torch.load(newest, weights_only=True)
    state["model"]["transformer.ln_f.weight"][0] = float("nan")
    torch.save(state, newest)
    capsys.readouterr()
    code = main(["train", "--config", str(config), "--resume", "--max-steps", "6"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "step_000000000004.pt: transformer.ln_f.weight holds NaN" in captured.out
    assert "falling back to step_000000000002.pt" in captured.out
    loss = float(captured.out.split("loss=")[1].split()[0])
    assert loss == loss  # finite: it trained on from step 2, not from the NaN weights


def test_nan_weights_in_an_init_from_folder_are_refused(tmp_path, capsys):
    config = _init_config(tmp_path, _llama_folder(tmp_path / "llama", nan=True))
    code = main(["train", "--config", str(config)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert "model.init_from" in lines[0] and "model.safetensors" in lines[0]
    assert "model.layers.0.mlp.up_proj.weight holds NaN or inf" in lines[0]
