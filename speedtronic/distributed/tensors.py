"""2.0.0 path of :mod:`speedtronic.diloco.tensors`."""

from speedtronic.diloco.tensors import *  # noqa: F403
from speedtronic.diloco.tensors import __all__  # noqa: F401
