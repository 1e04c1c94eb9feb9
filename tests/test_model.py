"""Reference transformer: shapes, GQA, RoPE, tying, causality, loss, recompute, registry."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from speedtronic.config import ConfigError, ModelConfig
from speedtronic.model import (
    GPT,
    GPTConfig,
    ReferenceTransformer,
    RotaryEmbedding,
    SwiGLU,
    apply_rope,
    build_model,
    register_model,
    registry,
)
from speedtronic.module_utils import set_gradient_checkpointing

TINY = {"vocab_size": 32, "block_size": 8, "n_layer": 2, "n_head": 4, "d_model": 32, "d_ff": 64}


def tiny(**overrides) -> ReferenceTransformer:
    torch.manual_seed(0)
    return ReferenceTransformer(**{**TINY, **overrides})


def test_logits_shape_loss_and_backward():
    model = tiny()
    ids = torch.randint(0, 32, (2, 8))
    out = model(ids, labels=ids)
    assert out["logits"].shape == (2, 8, 32)
    assert out["loss"].ndim == 0
    out["loss"].backward()
    assert all(p.grad is not None for p in model.parameters())


def test_parameter_counts_and_names_are_stable():
    smoke = ReferenceTransformer(
        vocab_size=128, block_size=64, n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=128
    )
    assert sum(p.numel() for p in smoke.parameters()) == 66_880
    assert sum(p.numel() for p in ReferenceTransformer().parameters()) == 3_295_488
    keys = list(tiny().state_dict())
    assert keys[:7] == [
        "transformer.wte.weight",
        "transformer.h.0.ln1.weight",
        "transformer.h.0.attn.q_proj.weight",
        "transformer.h.0.attn.k_proj.weight",
        "transformer.h.0.attn.v_proj.weight",
        "transformer.h.0.attn.out_proj.weight",
        "transformer.h.0.ln2.weight",
    ]
    assert "transformer.h.1.mlp.down_proj.weight" in keys
    assert keys[-2:] == ["transformer.ln_f.weight", "lm_head.weight"]
    assert not any("inv_freq" in k for k in keys)


def test_config_defaults_and_validation():
    assert GPTConfig(d_model=32).d_ff == 128
    assert GPTConfig(n_head=8).n_kv_head == 8
    with pytest.raises(ValueError, match="divisible by n_kv_head"):
        GPTConfig(n_head=8, n_kv_head=3)
    with pytest.raises(ValueError, match="positive"):
        GPTConfig(n_layer=0)
    with pytest.raises(TypeError, match="unknown model arguments: bogus"):
        ReferenceTransformer(bogus=1)
    renamed = {**TINY, "max_seq_len": 16}
    del renamed["block_size"]
    assert ReferenceTransformer(**renamed).config.block_size == 16
    assert SwiGLU(GPTConfig(d_model=256, d_ff=1024, n_head=8)).gate_proj.out_features == 688


def test_tied_weights_share_one_parameter():
    model = tiny()
    assert model.lm_head.weight is model.transformer.wte.weight
    assert sum(1 for _ in model.parameters()) == len(set(map(id, model.parameters())))
    untied = tiny(tie_weights=False)
    assert untied.lm_head.weight is not untied.transformer.wte.weight


def test_gqa_shapes_and_equivalence_to_repeated_mha():
    gqa = tiny(n_kv_head=2)
    attn = gqa.transformer.h[0].attn
    assert attn.k_proj.weight.shape == (2 * 8, 32)  # Hkv * D, C
    ids = torch.randint(0, 32, (2, 8))
    assert gqa(ids)["logits"].shape == (2, 8, 32)

    mha = tiny(n_kv_head=4)
    state = gqa.state_dict()
    for i in range(2):
        for proj in ("k_proj", "v_proj"):
            key = f"transformer.h.{i}.attn.{proj}.weight"
            heads = state[key].view(2, 8, 32)  # (Hkv, D, C)
            state[key] = heads.repeat_interleave(2, dim=0).reshape(4 * 8, 32)
    mha.load_state_dict(state)
    torch.testing.assert_close(gqa(ids)["logits"], mha(ids)["logits"], rtol=1e-5, atol=1e-5)


def test_rope_scores_depend_only_on_relative_position():
    rope = RotaryEmbedding(8)
    cos, sin = rope(16, torch.device("cpu"), torch.float32)
    q, k = torch.randn(8), torch.randn(8)

    def score(m: int, n: int) -> torch.Tensor:
        qm = apply_rope(q.view(1, 1, 1, 8), cos[m : m + 1], sin[m : m + 1])
        kn = apply_rope(k.view(1, 1, 1, 8), cos[n : n + 1], sin[n : n + 1])
        return (qm * kn).sum()

    torch.testing.assert_close(score(3, 1), score(10, 8), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(score(5, 5), score(0, 0), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(score(3, 1), score(3, 2))
    with pytest.raises(ValueError, match="even"):
        RotaryEmbedding(7)


def test_future_tokens_do_not_change_past_logits():
    model = tiny(n_kv_head=2).eval()
    ids = torch.randint(0, 32, (1, 8))
    changed = ids.clone()
    changed[0, 5:] = (changed[0, 5:] + 1) % 32
    a, b = model(ids)["logits"], model(changed)["logits"]
    torch.testing.assert_close(a[:, :5], b[:, :5])
    assert not torch.allclose(a[:, 5:], b[:, 5:])


def test_padding_mask_path_matches_causal_path_on_full_rows():
    model = tiny().eval()
    ids = torch.randint(0, 32, (2, 8))
    full = torch.ones(2, 8, dtype=torch.bool)
    torch.testing.assert_close(
        model(ids)["logits"], model(ids, attention_mask=full)["logits"], rtol=1e-5, atol=1e-5
    )
    with pytest.raises(ValueError, match="attention_mask"):
        model(ids, attention_mask=torch.ones(2, 8, 8))


def test_loss_matches_cross_entropy_and_label_conventions():
    model = tiny()
    ids = torch.randint(0, 32, (2, 8))
    labels = torch.randint(0, 32, (2, 8))
    labels[0, :3] = -100
    out = model(ids, labels=labels)
    expected = F.cross_entropy(out["logits"].reshape(-1, 32), labels.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out["loss"], expected)
    short = model(ids, labels=labels[:, 1:])["loss"]
    torch.testing.assert_close(
        short, F.cross_entropy(out["logits"][:, :-1].reshape(-1, 32), labels[:, 1:].reshape(-1))
    )
    ignored = model(ids, labels=torch.full((2, 8), -100))["loss"]
    assert ignored.item() == 0.0 and ignored.requires_grad
    with pytest.raises(ValueError, match="sequence length"):
        model(ids, labels=labels[:, :4])
    with pytest.raises(ValueError, match="exceeds model block size"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_gradient_checkpointing_gives_the_same_gradients():
    def grads(checkpointing: bool) -> dict[str, torch.Tensor]:
        model = tiny(n_kv_head=2)
        set_gradient_checkpointing(model, checkpointing)
        assert all(b.gradient_checkpointing is checkpointing for b in model.transformer.h)
        ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
        model(ids, labels=ids)["loss"].backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain, recomputed = grads(False), grads(True)
    for name, grad in plain.items():
        torch.testing.assert_close(grad, recomputed[name], rtol=1e-5, atol=1e-6)
    with pytest.raises(AttributeError, match="set_gradient_checkpointing"):
        set_gradient_checkpointing(torch.nn.Linear(2, 2))


def test_dropout_only_in_training():
    model = tiny(dropout=0.5)
    ids = torch.randint(0, 32, (2, 8))
    model.eval()
    torch.testing.assert_close(model(ids)["logits"], model(ids)["logits"])
    model.train()
    assert not torch.allclose(model(ids)["logits"], model(ids)["logits"])


def test_build_model_from_model_config_and_mapping():
    cfg = ModelConfig(vocab_size=64, max_seq_len=16, n_layer=1, n_head=4, n_kv_head=2, d_model=32)
    model = build_model(cfg)
    assert isinstance(model, GPT)
    assert model.config.block_size == 16 and model.config.n_kv_head == 2
    assert build_model({"name": "gpt", "d_model": 32, "n_head": 4, "n_layer": 1}).config.d_ff == 128


def test_unknown_model_and_bad_shapes_are_config_errors():
    with pytest.raises(ConfigError, match=r"model\.name: unknown model 'nope'; registered: .*gpt"):
        build_model(ModelConfig(name="nope"))
    with pytest.raises(ConfigError, match="even attention head dimension"):
        build_model(ModelConfig(d_model=36, n_head=4, n_layer=1))


def test_register_custom_model_factory():
    class Tiny(torch.nn.Module):
        def __init__(self, vocab_size: int, **kwargs):
            super().__init__()
            self.kwargs = kwargs
            self.emb = torch.nn.Embedding(vocab_size, 4)

    try:
        assert register_model("tiny_test_model")(Tiny) is Tiny
        model = build_model({"name": "tiny_test_model", "vocab_size": 10}, extra=3)
        assert isinstance(model, Tiny)
        assert model.kwargs["block_size"] == 128 and model.kwargs["extra"] == 3
        assert "tiny_test_model" in registry.names()
    finally:
        registry._factories.pop("tiny_test_model", None)
    with pytest.raises(ValueError, match="non-empty model name"):
        register_model("", Tiny)
    with pytest.raises(KeyError, match="unknown model 'zzz'"):
        registry.get("zzz")


def test_compat_import_paths():
    import speedtronic

    with warnings.catch_warnings():  # the 2.0.0 path warns (tests/test_compat.py checks it)
        warnings.simplefilter("ignore", DeprecationWarning)
        from speedtronic.registry import build_model as legacy_build

    assert legacy_build is build_model
    assert speedtronic.GPT is ReferenceTransformer
    assert speedtronic.register_model is register_model


def test_reference_transformer_takes_the_model_section():
    section = ModelConfig(vocab_size=32, max_seq_len=16, n_layer=1, n_head=2, d_model=16)
    model = ReferenceTransformer(section)
    assert model.config == GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, d_model=16)
    assert ReferenceTransformer(section, n_layer=2).config.n_layer == 2  # keywords replace
    assert GPTConfig().block_size == ModelConfig().max_seq_len  # one place for the defaults
    with pytest.raises(ConfigError, match="unknown configuration keys: bogus"):
        build_model({"d_model": 32, "bogus": 1})
