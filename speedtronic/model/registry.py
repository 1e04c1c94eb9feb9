"""Model registry: maps ``model.name`` to a factory that returns an ``nn.Module``.

Users bring their own model with ``register_model``::

    from speedtronic import register_model

    @register_model("tiny_mlp")
    def tiny_mlp(vocab_size: int, d_model: int, **kwargs):   # accept **kwargs
        return MyModule(vocab_size, d_model)

The model's ``forward`` receives a batch as keyword arguments (dict batches) or as
``(inputs, labels)`` (tuple batches, the built-in loader's form) and returns a loss tensor,
``{"loss": ...}`` or ``(loss, ...)`` (or ``{"logits": ...}`` for an inferred causal loss).
Registration is process-local: YAML can name a model but cannot import plugin code.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from torch import nn

__all__ = ["ModelFactory", "ModelRegistry", "build_model", "register_model", "registry"]

ModelFactory = Callable[..., Any]

# ModelConfig fields forwarded to every factory (``max_seq_len`` is passed as ``block_size``).
_FORWARDED = (
    "vocab_size",
    "n_layer",
    "n_head",
    "n_kv_head",
    "d_model",
    "d_ff",
    "dropout",
    "tie_weights",
    "rope_base",
)
_DEFAULTS: dict[str, Any] = {
    "name": "reference_transformer",
    "vocab_size": 512,
    "max_seq_len": 128,
    "n_layer": 4,
    "n_head": 8,
    "n_kv_head": None,
    "d_model": 256,
    "d_ff": None,
    "dropout": 0.0,
    "tie_weights": True,
    "rope_base": 10_000.0,
}


class ModelRegistry:
    """Name -> factory map. The built-in names resolve by importing ``speedtronic.model``."""

    builtin_names: ClassVar[frozenset[str]] = frozenset({"reference_transformer", "gpt"})

    def __init__(self) -> None:
        self._factories: dict[str, ModelFactory] = {}

    def register(self, name: str, factory: ModelFactory | None = None) -> Any:
        """Register ``factory`` under ``name``; without a factory, return a decorator.

        Returns the factory unchanged (classes work too). An existing name is overwritten.
        """
        if factory is None:

            def decorator(fn: ModelFactory) -> ModelFactory:
                return self.register(name, fn)

            if not isinstance(name, str) or not name:
                raise ValueError("a non-empty model name and callable factory are required")
            return decorator
        if not isinstance(name, str) or not name or not callable(factory):
            raise ValueError("a non-empty model name and callable factory are required")
        self._factories[name] = factory
        return factory

    def get(self, name: str) -> ModelFactory:
        """Return the factory for ``name``; ``KeyError`` naming the registered models."""
        if name not in self._factories and name in self.builtin_names:
            module = importlib.import_module("speedtronic.model.transformer")
            for builtin in self.builtin_names:
                self._factories.setdefault(builtin, module.ReferenceTransformer)
        try:
            return self._factories[name]
        except KeyError:
            known = ", ".join(self.names()) or "none"
            raise KeyError(f"unknown model '{name}'; registered models: {known}") from None

    def names(self) -> tuple[str, ...]:
        """Sorted registered and built-in names."""
        return tuple(sorted(set(self._factories) | self.builtin_names))

    def __contains__(self, name: object) -> bool:
        return name in self._factories or name in self.builtin_names

    def build(self, name: str, **kwargs: Any) -> Any:
        """Call the factory registered under ``name`` with ``kwargs``."""
        return self.get(name)(**kwargs)


registry = ModelRegistry()


def register_model(name: str, factory: ModelFactory | None = None) -> Any:
    """Register a model factory in the global registry (decorator or direct call)."""
    return registry.register(name, factory)


def _model_fields(model_config: Any) -> dict[str, Any]:
    """Read the ModelConfig fields from a dataclass, any attribute object or a mapping."""
    values = dict(_DEFAULTS)
    if model_config is None:
        return values
    for key in values:
        if isinstance(model_config, Mapping):
            if key in model_config:
                values[key] = model_config[key]
        elif hasattr(model_config, key):
            values[key] = getattr(model_config, key)
    if values["n_kv_head"] is None:
        values["n_kv_head"] = values["n_head"]
    if values["d_ff"] is None:
        values["d_ff"] = 4 * int(values["d_model"])
    return values


def build_model(model_config: Any = None, **overrides: Any) -> nn.Module:
    """Build the model named by ``model_config.name`` (the ``model`` config section).

    Every factory receives ``vocab_size``, ``block_size`` (= ``max_seq_len``), ``n_layer``,
    ``n_head``, ``n_kv_head``, ``d_model``, ``d_ff``, ``dropout``, ``tie_weights`` and
    ``rope_base``; ``overrides`` replace or extend them. ``gradient_checkpointing`` is not
    forwarded (the trainer applies it). An unknown name, or shapes the reference model
    rejects, raise ``ConfigError`` naming the setting before any training starts.
    """
    from speedtronic.config import ConfigError

    values = _model_fields(model_config)
    name = str(values.pop("name") or "reference_transformer")
    if name not in registry:
        known = ", ".join(registry.names())
        raise ConfigError(f"model.name: unknown model '{name}'; registered: {known}")
    kwargs: dict[str, Any] = {key: values[key] for key in _FORWARDED}
    kwargs["block_size"] = values["max_seq_len"]
    kwargs.update(overrides)
    factory = registry.get(name)
    from speedtronic.model.transformer import ReferenceTransformer

    if factory is not ReferenceTransformer:
        return factory(**kwargs)
    try:
        return factory(**kwargs)
    except ValueError as exc:  # shapes the config layer does not check (e.g. odd head dim)
        raise ConfigError(f"model ({name}): {exc}") from exc
