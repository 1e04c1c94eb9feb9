"""2.0.0 path of the outer optimizer and the master's loop (:mod:`speedtronic.diloco.master`)."""

from speedtronic.diloco.master import RoundMaster as MasterOuterLoop
from speedtronic.diloco.outer import NesterovOuterOptimizer, nesterov_update

__all__ = ["MasterOuterLoop", "NesterovOuterOptimizer", "nesterov_update"]
