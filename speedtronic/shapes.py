"""Compatibility module: 2.0.0 ``speedtronic.shapes`` names (now ``speedtronic.train.shapes``)."""

from __future__ import annotations

from speedtronic.train.shapes import (
    ShapeProfile,
    ShapeReport,
    ShapeWarning,
    resolve_shape_profile,
    validate_startup_shapes,
)

__all__ = [
    "ShapeProfile",
    "ShapeReport",
    "ShapeWarning",
    "resolve_shape_profile",
    "validate_startup_shapes",
]
