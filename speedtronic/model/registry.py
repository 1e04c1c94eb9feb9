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
from collections.abc import Callable
from typing import Any, ClassVar, overload

from torch import nn

from speedtronic.config import ConfigError, ModelConfig
from speedtronic.config.schema import build_section
from speedtronic.json_types import JSONView

__all__ = [
    "ModelFactory",
    "ModelRegistry",
    "Registration",
    "build_model",
    "register_model",
    "registry",
]

ModelFactory = Callable[..., nn.Module]
Registration = Callable[[ModelFactory], ModelFactory]
"""What ``register_model(name)`` returns: a decorator that registers the factory it wraps."""

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


class ModelRegistry:
    """Name -> factory map. The built-in names resolve by importing ``speedtronic.model``."""

    builtin_names: ClassVar[frozenset[str]] = frozenset({"reference_transformer", "gpt"})

    def __init__(self) -> None:
        self._factories: dict[str, ModelFactory] = {}

    @overload
    def register(self, name: str, factory: ModelFactory) -> ModelFactory: ...

    @overload
    def register(self, name: str, factory: None = None) -> Registration: ...

    def register(
        self, name: str, factory: ModelFactory | None = None
    ) -> ModelFactory | Registration:
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

    def build(self, name: str, **kwargs: object) -> nn.Module:
        """Call the factory registered under ``name`` with ``kwargs``."""
        return self.get(name)(**kwargs)


registry = ModelRegistry()


@overload
def register_model(name: str, factory: ModelFactory) -> ModelFactory: ...


@overload
def register_model(name: str, factory: None = None) -> Registration: ...


def register_model(name: str, factory: ModelFactory | None = None) -> ModelFactory | Registration:
    """Register a model factory in the global registry (decorator or direct call)."""
    return registry.register(name, factory) if factory is not None else registry.register(name)


def _model_section(model_config: ModelConfig | JSONView | None) -> ModelConfig:
    """The validated ``model`` section: as given, from a mapping, or the defaults."""
    if isinstance(model_config, ModelConfig):
        return model_config
    section = build_section("model", dict(model_config or {}))
    assert isinstance(section, ModelConfig)  # what build_section("model", ...) builds
    return section


def build_model(model_config: ModelConfig | JSONView | None = None, **overrides: Any) -> nn.Module:
    """Build the model named by ``model_config.name`` (the ``model`` config section).

    Every factory receives ``vocab_size``, ``block_size`` (= ``max_seq_len``), ``n_layer``,
    ``n_head``, ``n_kv_head``, ``d_model``, ``d_ff``, ``dropout``, ``tie_weights`` and
    ``rope_base``; ``overrides`` replace or extend them. ``gradient_checkpointing`` is not
    forwarded (the trainer applies it). An unknown name, or shapes the reference model
    rejects, raise ``ConfigError`` naming the setting before any training starts.
    """
    section = _model_section(model_config)
    name = section.name
    if name not in registry:
        known = ", ".join(registry.names())
        raise ConfigError(f"model.name: unknown model '{name}'; registered: {known}")
    factory = registry.get(name)
    from speedtronic.model.transformer import ReferenceTransformer

    if factory is not ReferenceTransformer:
        kwargs: dict[str, Any] = {key: getattr(section, key) for key in _FORWARDED}
        kwargs["block_size"] = section.max_seq_len
        return factory(**{**kwargs, **overrides})
    try:
        return ReferenceTransformer(section, **overrides)
    except ValueError as exc:  # shapes the config layer does not check (e.g. odd head dim)
        raise ConfigError(f"model ({name}): {exc}") from exc
