"""The reference decoder-only transformer (``reference_transformer``, alias ``gpt``).

Pre-norm blocks with RMSNorm, rotary position embeddings (rotate-half layout), grouped-query
attention through ``torch.nn.functional.scaled_dot_product_attention`` and a SwiGLU MLP. No
biases, no learned positional embedding, optional tied input/output embeddings.

Parameter names are part of the contract (checkpoints and Muon routing depend on them)::

    transformer.wte.weight
    transformer.h.{i}.ln1.weight
    transformer.h.{i}.attn.{q_proj,k_proj,v_proj,out_proj}.weight
    transformer.h.{i}.ln2.weight
    transformer.h.{i}.mlp.{gate_proj,up_proj,down_proj}.weight
    transformer.ln_f.weight
    lm_head.weight                      # the same Parameter as wte.weight when tied

Notation in shape comments: B batch, T sequence, C d_model, H query heads, Hkv key/value heads,
D head dim, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from speedtronic.config import ModelConfig

__all__ = [
    "GPT",
    "CausalSelfAttention",
    "GPTConfig",
    "GPTModel",
    "RMSNorm",
    "ReferenceModel",
    "ReferenceTransformer",
    "RotaryEmbedding",
    "SwiGLU",
    "Transformer",
    "TransformerBlock",
    "TransformerConfig",
    "apply_rope",
    "causal_lm_loss",
    "rotate_half",
]


@dataclass
class GPTConfig:
    """Shape of the reference transformer (all sizes in elements, not bytes).

    The 2.0.0 keyword form of the ``model`` section (``block_size`` is ``model.max_seq_len``);
    its defaults are :class:`~speedtronic.config.ModelConfig`'s. Built from a validated section
    with :meth:`from_model_config`; the checks below guard direct keyword construction.
    """

    vocab_size: int = ModelConfig.vocab_size
    block_size: int = ModelConfig.max_seq_len
    n_layer: int = ModelConfig.n_layer
    n_head: int = ModelConfig.n_head
    n_kv_head: int | None = ModelConfig.n_kv_head
    d_model: int = ModelConfig.d_model
    d_ff: int | None = ModelConfig.d_ff
    dropout: float = ModelConfig.dropout
    tie_weights: bool = ModelConfig.tie_weights
    rope_base: float = ModelConfig.rope_base
    norm_eps: float = ModelConfig.norm_eps

    @classmethod
    def from_model_config(cls, section: ModelConfig) -> GPTConfig:
        """The shape a ``model`` config section describes."""
        shape = {f.name: getattr(section, f.name) for f in fields(cls) if f.name != "block_size"}
        return cls(block_size=section.max_seq_len, **shape)

    def __post_init__(self) -> None:
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model
        dims = (
            self.vocab_size,
            self.block_size,
            self.n_layer,
            self.n_head,
            self.n_kv_head,
            self.d_model,
            self.d_ff,
        )
        if any(int(d) <= 0 for d in dims):
            raise ValueError("all GPT dimensions must be positive")
        if self.n_head % self.n_kv_head != 0:
            raise ValueError("n_head must be divisible by n_kv_head")
        if self.d_model % self.n_head != 0:
            raise ValueError("d_model must be divisible by n_head")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ValueError("dropout must be in [0, 1)")

    @property
    def head_dim(self) -> int:
        """Per-head width D = d_model // n_head."""
        return self.d_model // self.n_head


class RMSNorm(nn.Module):
    """Root-mean-square norm: statistics in fp32, scaling in the input dtype; no bias."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(dim=-1, keepdim=True)  # (..., 1)
        return x * torch.rsqrt(var + self.eps).to(x.dtype) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Split the last dim into halves (x1, x2) and return cat(-x2, x1) (GPT-NeoX layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, H, T, D) by the angles whose cos/sin are given as (T, D)."""
    return x * cos + rotate_half(x) * sin


class RotaryEmbedding(nn.Module):
    """Rotary position tables for one head width; positions always start at 0."""

    def __init__(self, head_dim: int, base: float = 10_000.0) -> None:
        super().__init__()
        if head_dim % 2 != 0:
            raise ValueError("RoPE requires an even attention head dimension")
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(
        self, seq_len: int, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(cos, sin)``, each (seq_len, D), in ``dtype`` on ``device``."""
        cached = self._cache
        if (
            cached is not None
            and cached[0].shape[0] >= seq_len
            and cached[0].device == torch.device(device)
            and cached[0].dtype == dtype
        ):
            return cached[0][:seq_len], cached[1][:seq_len]
        pos = torch.arange(seq_len, device=device, dtype=torch.float32)  # (T,)
        freqs = torch.outer(pos, self.inv_freq.to(device))  # (T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, D)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        self._cache = (cos, sin)
        return cos, sin


class CausalSelfAttention(nn.Module):
    """Grouped-query causal self-attention with RoPE on q and k."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_kv_head = int(config.n_kv_head or config.n_head)
        self.head_dim = config.d_model // config.n_head
        self.dropout = float(config.dropout)
        self.q_proj = nn.Linear(config.d_model, self.n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.d_model, self.n_kv_head * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.d_model, self.n_kv_head * self.head_dim, bias=False)
        self.out_proj = nn.Linear(self.n_head * self.head_dim, config.d_model, bias=False)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(
        self,
        x: torch.Tensor,
        rope: RotaryEmbedding,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape  # (B, T, C)
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        cos, sin = rope(T, x.device, q.dtype)  # (T, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.n_kv_head != self.n_head:
            repeat = self.n_head // self.n_kv_head
            k = k.repeat_interleave(repeat, dim=1)  # (B, H, T, D)
            v = v.repeat_interleave(repeat, dim=1)
        dropout_p = self.dropout if self.training else 0.0
        if attention_mask is None:
            # No padding: let SDPA pick a fused causal kernel, no dense mask is built.
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        else:
            mask = _padding_causal_mask(attention_mask, B, T, q.dtype)  # (B, 1, T, T)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)  # (B, T, C)
        return self.resid_dropout(self.out_proj(y))


def _padding_causal_mask(
    attention_mask: torch.Tensor, batch: int, seq_len: int, dtype: torch.dtype
) -> torch.Tensor:
    """Additive (B, 1, T, T) mask: -inf for padded keys and future positions, else 0."""
    if attention_mask.ndim != 2 or tuple(attention_mask.shape) != (batch, seq_len):
        raise ValueError("attention_mask must have shape (batch, sequence)")
    keys = attention_mask.to(torch.bool)[:, None, None, :]  # (B, 1, 1, T)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=attention_mask.device).tril()
    allowed = keys & causal  # (B, 1, T, T)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=attention_mask.device)
    return mask.masked_fill(~allowed, float("-inf"))


class SwiGLU(nn.Module):
    """Gated MLP: down(silu(gate(x)) * up(x)); hidden = 2/3 d_ff rounded up to n_head."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = int(int(config.d_ff) * (2 / 3))
        multiple = config.n_head  # 2.0.0 rounds to the head count; kept for checkpoint shapes
        hidden = multiple * math.ceil(hidden / multiple)
        self.gate_proj = nn.Linear(config.d_model, hidden, bias=False)
        self.up_proj = nn.Linear(config.d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, config.d_model, bias=False)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.gate_proj(x)) * self.up_proj(x)  # (B, T, hidden)
        return self.dropout(self.down_proj(h))  # (B, T, C)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(ln1(x)), then + mlp(ln2(x)); optional recompute."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = RMSNorm(config.d_model, config.norm_eps)
        self.attn = CausalSelfAttention(config)
        self.ln2 = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = SwiGLU(config)
        self.dropout = nn.Dropout(config.dropout)
        self.gradient_checkpointing = False

    def _forward(
        self, x: torch.Tensor, rope: RotaryEmbedding, mask: torch.Tensor | None
    ) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.ln1(x), rope, mask))  # (B, T, C)
        return x + self.mlp(self.ln2(x))

    def forward(
        self,
        x: torch.Tensor,
        rope: RotaryEmbedding,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            return checkpoint(self._forward, x, rope, attention_mask, use_reentrant=False)
        return self._forward(x, rope, attention_mask)


_CONFIG_FIELDS = tuple(f.name for f in fields(GPTConfig))


class ReferenceTransformer(nn.Module):
    """Decoder-only LM. ``forward(input_ids, labels=None, attention_mask=None) -> dict``.

    Built from a ``ModelConfig`` (``ReferenceTransformer(config.model)``) or, as in 2.0.0, from
    :class:`GPTConfig` keywords (``max_seq_len`` is accepted for ``block_size``); keywords given
    with a config replace its values. ``self.config`` is the resulting :class:`GPTConfig`.

    Labels follow the already-shifted contract: ``labels[:, t]`` is the token after
    ``input_ids[:, t]`` (length T); labels of length T-1 are compared with ``logits[:, :-1]``.
    Positions labelled -100 are ignored.
    """

    def __init__(self, config: ModelConfig | GPTConfig | None = None, **kwargs: Any) -> None:
        super().__init__()
        if "max_seq_len" in kwargs and "block_size" not in kwargs:
            kwargs["block_size"] = kwargs.pop("max_seq_len")
        unknown = sorted(set(kwargs) - set(_CONFIG_FIELDS))
        if unknown:
            raise TypeError(f"unknown model arguments: {', '.join(unknown)}")
        if isinstance(config, ModelConfig):
            config = GPTConfig.from_model_config(config)
        self.config = dataclasses.replace(config, **kwargs) if config else GPTConfig(**kwargs)
        cfg = self.config
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(cfg.vocab_size, cfg.d_model),
                "drop": nn.Dropout(cfg.dropout),
                "h": nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layer)),
                "ln_f": RMSNorm(cfg.d_model, cfg.norm_eps),
            }
        )
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_base)
        if cfg.tie_weights:
            self.lm_head.weight = self.transformer.wte.weight
        self.gradient_checkpointing = False
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    @property
    def vocab_size(self) -> int:
        """Output vocabulary size V."""
        return self.config.vocab_size

    def set_gradient_checkpointing(self, enabled: bool = True) -> ReferenceTransformer:
        """Recompute each block's activations in backward (less memory, more compute)."""
        self.gradient_checkpointing = bool(enabled)
        for block in self.transformer.h:
            block.gradient_checkpointing = bool(enabled)
        return self

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        **_: object,
    ) -> dict[str, torch.Tensor]:
        if input_ids.ndim != 2:
            raise ValueError("input_ids must have shape (batch, sequence)")
        T = input_ids.shape[1]
        if self.config.block_size < T:
            raise ValueError(
                f"sequence length {T} exceeds model block size {self.config.block_size}"
            )
        x = self.transformer.drop(self.transformer.wte(input_ids))  # (B, T, C)
        for block in self.transformer.h:
            x = block(x, self.rope, attention_mask)  # (B, T, C)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)  # (B, T, V)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = causal_lm_loss(logits, labels)
        return out


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of (B, T, V) logits against already-shifted (B, T|T-1) labels."""
    B, T, V = logits.shape
    if labels.ndim != 2 or labels.shape[0] != B:
        raise ValueError("labels must have shape (batch, sequence)")
    if labels.shape[1] == T:
        aligned = logits
    elif labels.shape[1] == T - 1:
        aligned = logits[:, :-1]
    else:
        raise ValueError("labels must have sequence length or sequence length - 1")
    labels = labels.to(device=logits.device, dtype=torch.long)
    if labels.numel() == 0:
        return logits.sum() * 0.0
    # sum / count instead of reduction="mean": identical value, but an all-ignored batch gives
    # a differentiable 0 instead of NaN without a host sync to detect it.
    total = F.cross_entropy(
        aligned.reshape(-1, V), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )
    count = (labels != -100).sum().clamp(min=1)
    return total / count


GPT = ReferenceTransformer
Transformer = ReferenceTransformer
ReferenceModel = ReferenceTransformer
GPTModel = ReferenceTransformer
TransformerConfig = GPTConfig
