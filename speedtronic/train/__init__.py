"""The training loop and everything it directly owns.

Modules:
    trainer    -- ``Trainer`` (the loop), ``TrainResult``, ``SyncCoordinator``
    runtime    -- ``build_runtime`` / ``train_from_config`` (config -> running trainer)
    precision  -- device and mixed-precision resolution, autocast, GradScaler
    launch     -- ``train_command`` behind ``speedtronic train`` (signals, progress bar)
    shapes     -- startup shape validation (owned by the optimizer side)
    ooo        -- out-of-order backprop stream scheduling (owned by the optimizer side)

Nothing is imported eagerly: ``import speedtronic.train`` stays cheap.
"""

from __future__ import annotations
