"""``model.init_from``: a run starts from a transformers checkpoint saved in the test.

Tiny random Llama checkpoints (single file, sharded, GQA + tied embeddings) are saved by
transformers itself; the step-0 logits must equal transformers' in fp32, a few steps must
train, and the export must load back into transformers. Refusals name the field that differs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from tokenizer_fixtures import corpus_text, train_bpe

from speedtronic.cli import main
from speedtronic.config import ConfigError, SpeedtronicConfig
from speedtronic.model.hf_import import load_hf_weights, resolve_init_from
from speedtronic.train.runtime import build_runtime

transformers = pytest.importorskip("transformers")

SHAPE = {
    "vocab_size": 320,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,  # the reference RMSNorm's (transformers' default is 1e-6)
    "rope_theta": 500.0,
}


def save_llama(folder: Path, *, tokenizer: bool = False, shard: str | None = None, **shape):
    """A random LlamaForCausalLM saved by transformers at ``folder``; returns the model."""
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**SHAPE, **shape})).eval()
    with torch.no_grad():  # norms away from 1, so a weight left out would show
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(str(folder), **kwargs)
    if tokenizer:
        train_bpe(folder / "tokenizer.json", vocab_size=300)
    return model


def run_config(tmp_path: Path, **sections) -> dict:
    (tmp_path / "corpus.txt").write_text(corpus_text(300), encoding="utf-8")
    values = {
        "run": {"device": "cpu", "max_steps": 3, "output_dir": str(tmp_path / "run")},
        "model": {"max_seq_len": 32},
        "data": {"micro_batch_size": 2, "target_batch_size": 2},
        "optimizer": {"lr": 1e-3},
        "scheduler": {"warmup_steps": 1},
        "logging": {"level": "WARNING"},
    }
    for name, fields in sections.items():
        values.setdefault(name, {}).update(fields)
    return values


@torch.no_grad()
def logit_gap(ours: torch.nn.Module, theirs: torch.nn.Module, vocab: int, length: int = 32):
    inputs = torch.randint(vocab, (3, length), generator=torch.Generator().manual_seed(1))
    return float(
        (ours.eval()(inputs)["logits"] - theirs.eval()(input_ids=inputs).logits).abs().max()
    )


@pytest.mark.parametrize(
    ("shape", "shard"),
    [
        ({}, None),
        ({"num_key_value_heads": 2, "tie_word_embeddings": True}, None),
        ({"num_key_value_heads": 2}, "40KB"),
    ],
    ids=["llama", "gqa-tied", "sharded"],
)
def test_step_zero_logits_equal_transformers_then_train_and_export(tmp_path, capsys, shape, shard):
    source = tmp_path / "hf-in"
    reference = save_llama(source, tokenizer=True, shard=shard, **shape)
    if shard:
        assert len(list(source.glob("model-*-of-*.safetensors"))) > 1
    values = run_config(tmp_path, data={"text_path": str(tmp_path / "corpus.txt")})
    config = SpeedtronicConfig.from_dict({**values, "model": {"init_from": str(source)}})
    trainer, _ = build_runtime(config)
    shaped = config.model
    assert (shaped.n_layer, shaped.d_model, shaped.vocab_size) == (2, 32, 320)
    assert shaped.tie_weights == bool(shape.get("tie_word_embeddings", False))
    assert shaped.max_seq_len == 64  # the checkpoint's context
    assert config.data.tokenizer == str(source)  # its tokenizer, not bytes
    assert logit_gap(trainer.model, reference, 320, 64) <= 1e-5

    # the CLI: the same run through --init-from, a few steps, then the export
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(values))
    assert main(["train", "--config", str(path), "--init-from", str(source)]) == 0
    checkpoint = sorted((tmp_path / "run" / "checkpoints").glob("*.pt"))[-1]
    out = tmp_path / "hf-out"
    code = main(["export", "--checkpoint", str(checkpoint), "-o", str(out)])
    assert code == 0, capsys.readouterr().err
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)["model"]
    trained = trainer.model.__class__(config.model)
    trained.load_state_dict(state)
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(out)).float()
    assert logit_gap(trained, exported, 320) <= 1e-5
    assert logit_gap(trained, reference, 320) > 1e-4  # the steps changed the weights
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tokenizer("the quick brown fox")["input_ids"]


def test_bf16_weights_convert_exactly(tmp_path):
    reference = save_llama(tmp_path / "src").to(torch.bfloat16)
    reference.save_pretrained(str(tmp_path / "bf16"))
    config = SpeedtronicConfig.from_dict({"model": {"init_from": str(tmp_path / "bf16")}})
    checkpoint = resolve_init_from(config)
    model = trainer_model(config)
    assert load_hf_weights(model, checkpoint) == 2 * 9 + 3  # untied: embed, norm, lm_head
    assert torch.equal(model.transformer.wte.weight, reference.model.embed_tokens.weight.float())


def trainer_model(config: SpeedtronicConfig) -> torch.nn.Module:
    from speedtronic.model import build_model

    return build_model(config.model)


def test_a_setting_that_differs_from_the_checkpoint_names_both_values(tmp_path, capsys):
    save_llama(tmp_path / "hf")
    spec = str(tmp_path / "hf")
    with pytest.raises(ConfigError, match=r"model\.n_layer is 4 but .* num_hidden_layers 2"):
        resolve_init_from(SpeedtronicConfig.from_dict({"model": {"init_from": spec, "n_layer": 4}}))
    with pytest.raises(ConfigError, match=r"max_seq_len is 128 .* max_position_embeddings 64"):
        resolve_init_from(
            SpeedtronicConfig.from_dict({"model": {"init_from": spec, "max_seq_len": 128}})
        )
    agreeing = {"init_from": spec, "n_layer": 2, "d_model": 32, "d_ff": 96, "max_seq_len": 16}
    config = SpeedtronicConfig.from_dict({"model": agreeing})
    resolve_init_from(config)
    assert config.model.max_seq_len == 16  # a shorter training context is kept
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(run_config(tmp_path, model={"n_head": 8})))
    capsys.readouterr()  # transformers' progress bars
    code = main(["train", "--config", str(path), "--init-from", spec])
    err = capsys.readouterr().err
    assert code == 2
    assert "model.n_head is 8 but model.init_from" in err and "num_attention_heads 4" in err
    assert len(err.strip().splitlines()) == 1


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    values = json.loads(path.read_text())
    values.update(changes)
    path.write_text(json.dumps(values))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 500.0}},
            "LlamaForCausalLM with rope_parameters",
        ),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "with rope_scaling"),
        ({"attention_bias": True}, "with attention_bias = true"),
        ({"mlp_bias": True}, "with mlp_bias = true"),
        ({"intermediate_size": 66}, "with intermediate_size = 66"),
        ({"architectures": ["GPT2LMHeadModel"]}, "is a GPT2LMHeadModel; supported"),
    ],
)
def test_a_checkpoint_the_reference_model_cannot_match_is_refused(tmp_path, changes, message):
    save_llama(tmp_path / "hf")
    if "rope_scaling" in changes:  # the 4.x spelling
        values = json.loads((tmp_path / "hf" / "config.json").read_text())
        values.pop("rope_parameters", None)
        (tmp_path / "hf" / "config.json").write_text(json.dumps(values))
    _edit_config(tmp_path / "hf", **changes)
    config = SpeedtronicConfig.from_dict({"model": {"init_from": str(tmp_path / "hf")}})
    with pytest.raises(ConfigError, match=message) as caught:
        resolve_init_from(config)
    assert "\n" not in str(caught.value)


def test_rope_scaling_beside_rope_parameters_is_refused_like_rope_scaling_alone(tmp_path):
    """transformers 5 writes ``rope_parameters``; a ``rope_scaling`` beside it (a 4.x field a
    hand edit or a converter left) would change the logits and used to be ignored."""
    save_llama(tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["rope_parameters"]
    config = SpeedtronicConfig.from_dict({"model": {"init_from": str(tmp_path / "hf")}})
    for scaling in ({"rope_type": "yarn", "factor": 4.0}, "linear"):
        _edit_config(tmp_path / "hf", rope_scaling=scaling)
        with pytest.raises(ConfigError, match="LlamaForCausalLM with rope_scaling = ") as caught:
            resolve_init_from(config)
        assert "\n" not in str(caught.value)
    _edit_config(tmp_path / "hf", rope_scaling={"rope_type": "default"})
    assert resolve_init_from(config) is not None


@pytest.mark.parametrize("eps", [1e-6, None], ids=["1e-6", "absent"])
def test_rms_norm_eps_of_transformers_default_is_taken_and_exported(tmp_path, eps):
    """``rms_norm_eps`` 1e-6 (transformers' default, also when config.json leaves it out)
    becomes model.norm_eps: the step-0 logits equal transformers', and the export keeps it."""
    from speedtronic.model.export import export_hf

    reference = save_llama(tmp_path / "hf", rms_norm_eps=1e-6)
    if eps is None:
        values = json.loads((tmp_path / "hf" / "config.json").read_text())
        del values["rms_norm_eps"]
        (tmp_path / "hf" / "config.json").write_text(json.dumps(values))
    config = SpeedtronicConfig.from_dict({"model": {"init_from": str(tmp_path / "hf")}})
    checkpoint = resolve_init_from(config)
    model = trainer_model(config)
    load_hf_weights(model, checkpoint)
    assert config.model.norm_eps == 1e-6
    with torch.no_grad():  # tiny activations, where eps matters: 1e-5 would differ
        model.transformer.wte.weight.mul_(1e-3)
        reference.model.embed_tokens.weight.mul_(1e-3)
    assert logit_gap(model, reference, 320, 64) <= 1e-5
    wrong = build_default_eps(config)
    wrong.load_state_dict(model.state_dict())
    assert logit_gap(wrong, reference, 320, 64) > 1e-3  # the eps is what made them equal
    export_hf(model, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["rms_norm_eps"] == 1e-6
    given = {"init_from": str(tmp_path / "hf"), "norm_eps": 1e-5}
    with pytest.raises(ConfigError, match=r"model\.norm_eps is 1e-05 but .* rms_norm_eps 1e-06"):
        resolve_init_from(SpeedtronicConfig.from_dict({"model": given}))


def build_default_eps(config: SpeedtronicConfig) -> torch.nn.Module:
    from speedtronic.model import build_model

    values = {**config.to_dict()["model"], "norm_eps": 1e-5, "init_from": None}
    return build_model(values)


def test_an_index_that_names_files_outside_the_folder_is_refused(tmp_path):
    save_llama(tmp_path / "hf", shard="40KB")
    index = tmp_path / "hf" / "model.safetensors.index.json"
    document = json.loads(index.read_text())
    (tmp_path / "outside.safetensors").write_bytes(b"")
    config = SpeedtronicConfig.from_dict({"model": {"init_from": str(tmp_path / "hf")}})
    for name in ("../outside.safetensors", str(tmp_path / "outside.safetensors"), "a//b", 7):
        first = next(iter(document["weight_map"]))
        edited = {**document, "weight_map": {**document["weight_map"], first: name}}
        index.write_text(json.dumps(edited))
        with pytest.raises(ConfigError, match="not a relative path inside the model folder"):
            resolve_init_from(config)


def test_a_bare_name_that_is_no_folder_is_named_at_once(tmp_path, monkeypatch, capsys):
    """No Hub round trip (the review waited 33 s of retries): a Hub id has an owner."""
    import time

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # would only answer with retries
    started = time.monotonic()
    for spec in ("my-export", "my-export@main"):
        config = SpeedtronicConfig.from_dict({"model": {"init_from": spec}})
        with pytest.raises(ConfigError, match=f"no local folder '{spec}'"):
            resolve_init_from(config)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(run_config(tmp_path)))
    assert main(["validate", "--config", str(path), "--init-from", "my-export"]) == 2
    assert "error: model.init_from: no local folder 'my-export'" in capsys.readouterr().err
    assert time.monotonic() - started < 5


def test_qwen2_is_refused_for_its_biases_and_mistral_taken_without_a_window(tmp_path):
    qwen = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SHAPE))
    qwen.save_pretrained(str(tmp_path / "qwen"))
    config = SpeedtronicConfig.from_dict({"model": {"init_from": str(tmp_path / "qwen")}})
    with pytest.raises(ConfigError, match="Qwen2ForCausalLM with attention biases"):
        resolve_init_from(config)

    torch.manual_seed(5)
    windowed = transformers.MistralConfig(**SHAPE, sliding_window=16)
    transformers.MistralForCausalLM(windowed).save_pretrained(str(tmp_path / "window"))
    config = SpeedtronicConfig.from_dict({"model": {"init_from": str(tmp_path / "window")}})
    with pytest.raises(ConfigError, match="MistralForCausalLM with sliding_window = 16"):
        resolve_init_from(config)

    mistral = transformers.MistralForCausalLM(
        transformers.MistralConfig(**SHAPE, sliding_window=None)
    ).eval()
    mistral.save_pretrained(str(tmp_path / "mistral"))
    config = SpeedtronicConfig.from_dict({"model": {"init_from": str(tmp_path / "mistral")}})
    checkpoint = resolve_init_from(config)
    model = trainer_model(config)
    load_hf_weights(model, checkpoint)
    assert logit_gap(model, mistral, 320, 64) <= 1e-5


def test_a_weight_file_with_a_tensor_the_model_has_no_place_for(tmp_path):
    from safetensors.torch import load_file, save_file

    save_llama(tmp_path / "hf")
    config = SpeedtronicConfig.from_dict({"model": {"init_from": str(tmp_path / "hf")}})
    checkpoint = resolve_init_from(config)  # resolved while the file is whole
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    weights["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(32)
    save_file(weights, str(tmp_path / "hf" / "model.safetensors"))

    def again():  # issue 39: the headers are read at resolve, before the model is built
        fresh = {"model": {"init_from": str(tmp_path / "hf")}}
        return resolve_init_from(SpeedtronicConfig.from_dict(fresh))

    for load in (again, lambda: load_hf_weights(trainer_model(config), checkpoint)):
        with pytest.raises(ConfigError, match=r"q_proj\.bias, which the reference model has no"):
            load()
    del weights["model.layers.0.self_attn.q_proj.bias"], weights["model.norm.weight"]
    save_file(weights, str(tmp_path / "hf" / "model.safetensors"))
    for load in (again, lambda: load_hf_weights(trainer_model(config), checkpoint)):
        with pytest.raises(ConfigError, match=r"lacks model\.norm\.weight"):
            load()


def test_the_diloco_master_publishes_the_loaded_weights_and_a_worker_needs_no_weights(tmp_path):
    from safetensors.torch import load_file

    save_llama(tmp_path / "hf", tokenizer=True, num_key_value_heads=2)
    exchange = f"file://{tmp_path / 'exchange'}"
    distributed = {"enabled": True, "repo_id": exchange, "inner_steps": 2}
    values = run_config(tmp_path, distributed={**distributed, "role": "master", "node_id": "m"})
    values["model"] = {"init_from": str(tmp_path / "hf")}
    trainer, _ = build_runtime(SpeedtronicConfig.from_dict(values))
    loaded = load_file(str(tmp_path / "hf" / "model.safetensors"))
    global_zero = trainer.coordinator.master.global_state
    assert torch.equal(
        global_zero["transformer.h.1.attn.k_proj.weight"],
        loaded["model.layers.1.self_attn.k_proj.weight"],
    )
    assert torch.equal(global_zero["transformer.wte.weight"], loaded["model.embed_tokens.weight"])

    shape_only = tmp_path / "shape-only"  # what a worker needs: config and tokenizer
    shape_only.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (shape_only / name).write_bytes((tmp_path / "hf" / name).read_bytes())
    values = run_config(tmp_path, distributed={**distributed, "role": "worker", "node_id": "w"})
    values["model"] = {"init_from": str(shape_only)}
    config = SpeedtronicConfig.from_dict(values)
    trainer, _ = build_runtime(config)
    assert config.model.n_kv_head == 2 and config.data.tokenizer == str(shape_only)
    master = SpeedtronicConfig.from_dict({**values, "distributed": {**distributed}})
    with pytest.raises(ConfigError, match=r"has no model\.safetensors"):
        resolve_init_from(master)  # the master does need them


def test_init_from_needs_the_reference_model_and_a_usable_source(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.name is 'mine'"):
        SpeedtronicConfig.from_dict({"model": {"name": "mine", "init_from": "org/x"}})
    config = SpeedtronicConfig.from_dict({"model": {"init_from": str(tmp_path / "nope")}})
    with pytest.raises(ConfigError, match="neither a folder nor a Hub repo id"):
        resolve_init_from(config)
    (tmp_path / "empty").mkdir()
    config = SpeedtronicConfig.from_dict({"model": {"init_from": str(tmp_path / "empty")}})
    with pytest.raises(ConfigError, match=r"has no config\.json"):
        resolve_init_from(config)


def test_eval_sample_and_export_take_the_shape_and_tokenizer_from_init_from(tmp_path, capsys):
    source = tmp_path / "hf"
    reference = save_llama(source, tokenizer=True, tie_word_embeddings=True)
    parameters = sum(p.numel() for p in reference.parameters())
    values = run_config(
        tmp_path,
        model={"init_from": str(source)},
        data={"text_path": str(tmp_path / "corpus.txt")},
        eval={"holdout": 0.1},
    )
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(values))
    capsys.readouterr()
    assert main(["validate", "--config", str(path)]) == 0  # the dry run sees the checkpoint
    assert f"config OK: {parameters:,} parameters" in capsys.readouterr().out
    assert main(["train", "--config", str(path)]) == 0
    capsys.readouterr()
    assert main(["eval", "--config", str(path), "--format", "json"]) == 0
    scored = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert scored["step"] == 3 and 0 < scored["loss"] < 10  # the checkpoint's shape loaded
    assert main(["sample", "--config", str(path), "--prompt", "the quick", "--seed", "1"]) == 0
    assert capsys.readouterr().out.startswith("the quick")
    assert main(["export", "--config", str(path), "-o", str(tmp_path / "out")]) == 0
    # the same tokenizer; the export's post-processor puts the end-of-text token first, as
    # `sample` does (issue 29), so it is the one field that differs
    exported = json.loads((tmp_path / "out" / "tokenizer.json").read_text())
    original = json.loads((source / "tokenizer.json").read_text())
    exported.pop("post_processor")
    original.pop("post_processor", None)
    assert exported == original


def test_the_memory_bench_stays_under_its_bound(tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from init_from_memory import main as bench

    output = tmp_path / "memory.json"
    # 19 MiB of weights: at 5 MiB (d_model 128, 2 layers) a megabyte of allocator noise in
    # either child decided the bf16 row (CI: ours 3.7 MiB, the peer's 2.5 MiB, one run in many)
    args = ["--d-model", "256", "--layers", "4", "--vocab", "4000", "--output", str(output)]
    assert bench(args) == 0
    result = json.loads(output.read_text())
    assert [row["checkpoint"] for row in result["rows"]] == [
        "fp32, one file",
        "fp32, 4 shards",
        "bf16, one file",
    ]
    assert result["worst_ratio"] <= 1.3
    assert all(row["ours_extra_bytes"] < row["peer_extra_bytes"] for row in result["rows"])
