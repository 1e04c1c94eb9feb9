"""Compatibility path for 2.0.0 code: the registry now lives in ``speedtronic.model.registry``."""

from speedtronic.model.registry import (
    ModelFactory,
    ModelRegistry,
    build_model,
    register_model,
    registry,
)

__all__ = ["ModelFactory", "ModelRegistry", "build_model", "register_model", "registry"]
