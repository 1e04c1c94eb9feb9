"""Reference transformer and model registry (``speedtronic.model``).

``build_model(config.model)`` returns the ``nn.Module`` named by ``model.name``; users add
their own with ``register_model("name")``. See ``transformer.py`` for the architecture and
the stable parameter names.
"""

from speedtronic.model.registry import (
    ModelFactory,
    ModelRegistry,
    build_model,
    register_model,
    registry,
)
from speedtronic.model.transformer import (
    GPT,
    CausalSelfAttention,
    GPTConfig,
    GPTModel,
    ReferenceModel,
    ReferenceTransformer,
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
    Transformer,
    TransformerBlock,
    TransformerConfig,
    apply_rope,
    causal_lm_loss,
    rotate_half,
)

__all__ = [
    "GPT",
    "CausalSelfAttention",
    "GPTConfig",
    "GPTModel",
    "ModelFactory",
    "ModelRegistry",
    "RMSNorm",
    "ReferenceModel",
    "ReferenceTransformer",
    "RotaryEmbedding",
    "SwiGLU",
    "Transformer",
    "TransformerBlock",
    "TransformerConfig",
    "apply_rope",
    "build_model",
    "causal_lm_loss",
    "register_model",
    "registry",
    "rotate_half",
]
