"""Configs shipped inside the package (package data, so a wheel carries them).

``diloco.yaml`` is the embedded main job: what ``speedtronic run`` runs when neither
``--config`` nor ``SPEEDTRONIC_CONFIG`` names a config. It is byte for byte
``configs/diloco.yaml`` of the source tree (the copy compose.yaml and k8s/ mount); a test
(tests/test_cli_main_job.py) fails when the two differ, so an edit goes to both.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["MAIN_JOB"]

#: The embedded main job (DumbDiLoCo over a shared directory, CPU-sized).
MAIN_JOB = Path(__file__).resolve().parent / "diloco.yaml"
