"""The regional relay: an aiohttp server with a bounded cache, cut-through, long-poll and fan-out.

See :mod:`deltarl.relay.server` for the HTTP API and ``infra/README.md`` for deployment.
"""

from __future__ import annotations

from deltarl.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "runner": ("RelayServer",),
    "config": ("RelayConfig",),
})
