"""2.0.0 path of the Hub transport (:mod:`speedtronic.diloco.hub`)."""

from speedtronic.diloco.hub import HubClient, HubTransport
from speedtronic.diloco.transport import GlobalMetadata, HubError, HubUnavailable

__all__ = ["GlobalMetadata", "HubClient", "HubError", "HubTransport", "HubUnavailable"]
