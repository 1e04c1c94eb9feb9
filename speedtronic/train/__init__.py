"""The training loop and everything it directly owns.

Modules:
    trainer    -- ``Trainer`` (the loop: ``fit``, ``request_stop``, ``last_heartbeat``)
    state      -- ``TrainerCheckpoint`` (the trainer's parts, saves, resume), the batch stream
    sync       -- ``NodeSync`` (the trainer's coordinator seam and rank agreement)
    result     -- ``TrainResult``, ``SyncCoordinator``, the loop's stop errors
    forward    -- the user-model contract: batch movement/counting, forward call, loss resolution
    features   -- gradient checkpointing, ``torch.compile`` with fallback, OOO scheduler setup
    runtime    -- ``build_runtime`` / ``train_from_config`` (config -> running trainer)
    precision  -- device and mixed-precision resolution, autocast, GradScaler
    shapes     -- startup shape validation
    ooo        -- out-of-order backprop stream scheduling

Nothing is imported eagerly: ``import speedtronic.train`` stays cheap.
"""

from __future__ import annotations
