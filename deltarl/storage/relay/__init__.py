"""The regional relay: an aiohttp server with a bounded cache, cut-through, long-poll and fan-out.

See :mod:`deltarl.storage.relay.server` for the HTTP API and ``infra/README.md`` for deployment.
"""

from deltarl.storage.relay.client import RelayClient
from deltarl.storage.relay.config import RelayConfig
from deltarl.storage.relay.runner import BackgroundRelay, RelayServer
from deltarl.storage.relay.server import create_app
from deltarl.storage.relay.upstream import HTTPUpstream, StoreUpstream, Upstream, make_upstream

__all__ = [
    "BackgroundRelay",
    "HTTPUpstream",
    "RelayClient",
    "RelayConfig",
    "RelayServer",
    "StoreUpstream",
    "Upstream",
    "create_app",
    "make_upstream",
]
