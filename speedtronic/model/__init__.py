"""Reference transformer and model registry (``speedtronic.model``).

``build_model(config.model)`` returns the ``nn.Module`` named by ``model.name``; users add
their own with ``register_model("name")``. See ``transformer.py`` for the architecture and
the stable parameter names.
"""

from speedtronic.model import transformer
from speedtronic.model.registry import (
    ModelFactory,
    ModelRegistry,
    build_model,
    register_model,
    registry,
)
from speedtronic.model.transformer import *  # noqa: F403 (the names of transformer.__all__)

__all__ = ["ModelFactory", "ModelRegistry", "build_model", "register_model", "registry"]
__all__ += transformer.__all__
