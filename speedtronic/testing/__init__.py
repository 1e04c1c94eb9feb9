"""Test doubles that speak real protocols (the Hub emulator lives in :mod:`.hub_server`)."""

from __future__ import annotations

__all__ = ["FaultConfig", "HubEmulator"]


def __getattr__(name: str):
    if name in __all__:
        from speedtronic.testing import hub_server

        return getattr(hub_server, name)
    raise AttributeError(name)
