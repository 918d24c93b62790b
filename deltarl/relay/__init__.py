"""The regional relay: an aiohttp server with a bounded cache, cut-through, long-poll and fan-out.

See :mod:`deltarl.relay.server` for the HTTP API and ``infra/README.md`` for deployment.
"""

from deltarl.relay.config import RelayConfig, RelayProcessConfig
from deltarl.relay.nginx import NginxRelayConfig, nginx_config
from deltarl.relay.runner import BackgroundRelay, RelayServer
from deltarl.relay.server import create_app
from deltarl.storage.http_client import RelayClient

__all__ = [
    "BackgroundRelay",
    "NginxRelayConfig",
    "RelayClient",
    "RelayConfig",
    "RelayProcessConfig",
    "RelayServer",
    "create_app",
    "nginx_config",
]
