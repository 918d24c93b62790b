"""Serve one Prometheus registry over HTTP (``GET /metrics``) on a thread, for processes without a web server.

Every process builds its own ``CollectorRegistry`` (never prometheus_client's global one), so tests
and one-process demos can run many actors, trainers or followers side by side.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


class MetricsServer:
    """``registry`` at ``http://host:port/metrics`` until :meth:`close`; ``port=0`` picks a free port.

    Example::

        server = MetricsServer(metrics.registry, port=9400)  # scrape http://host:9400/metrics
        ...
        server.close()
    """

    def __init__(self, registry: Any, *, port: int, host: str = "0.0.0.0") -> None:
        from prometheus_client import start_http_server

        if not 0 <= port <= 65535:
            raise ValueError(f"metrics port must be 0-65535, got {port}")
        self._httpd, self._thread = start_http_server(port, addr=host, registry=registry)
        self.host = host
        self.port: int = int(self._httpd.server_address[1])
        log.info("metrics at http://%s:%d/metrics", host, self.port)

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and free the port (idempotent)."""
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join(timeout=5)
        self._httpd.server_close()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

