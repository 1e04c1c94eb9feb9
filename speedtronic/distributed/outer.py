"""2.0.0 path of :mod:`speedtronic.diloco.outer`."""

from speedtronic.diloco.outer import MasterOuterLoop, NesterovOuterOptimizer, nesterov_update

__all__ = ["MasterOuterLoop", "NesterovOuterOptimizer", "nesterov_update"]
