"""Test doubles that speak real protocols (the Hub emulator lives in :mod:`.hub_server`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from speedtronic.testing.hub_server import FaultConfig, HubEmulator

__all__ = ["FaultConfig", "HubEmulator"]


def __getattr__(name: str) -> object:
    """``FaultConfig`` and ``HubEmulator``, imported from `hub_server` on first use."""
    if name in __all__:
        from speedtronic.testing import hub_server

        return getattr(hub_server, name)
    raise AttributeError(name)
