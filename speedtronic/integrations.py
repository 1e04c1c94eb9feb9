"""A deprecated 2.0.0 import path: its row in ``speedtronic.compat.ALIASES`` names the modules
that hold its names now."""

from speedtronic import compat

__all__, __getattr__, __dir__ = compat.deprecated_module(__name__)
del compat
