"""Running a relay: in the current event loop (:class:`RelayServer`) or in a background thread
with its own loop (:class:`BackgroundRelay`, for synchronous callers such as ``HTTPStore`` tests)."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from types import TracebackType
from typing import Any

from aiohttp import web

from deltarl.relay.config import RelayConfig
from deltarl.relay.objects import ObjectService
from deltarl.relay.server import METRICS, SERVICE, create_app, request_log
from deltarl.storage.aio import AsyncSource
from deltarl.storage.store import ObjectStore


class RelayServer:
    """A relay listening on ``host:port`` (port 0 picks a free one) in the running loop."""

    def __init__(self, upstream: str | ObjectStore | AsyncSource, config: RelayConfig, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.app = create_app(upstream, config)
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def service(self) -> ObjectService:
        return self.app[SERVICE]

    def counters(self) -> dict[str, float]:
        """Every metric sample by name (``name{label=value}``), e.g. ``deltarl_relay_served_bytes_total``."""
        out: dict[str, float] = {}
        for family in self.app[METRICS].registry.collect():
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                label = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                out[sample.name + (f"{{{label}}}" if label else "")] = sample.value
        return out

    async def start(self) -> RelayServer:
        # handler_cancellation: a client that leaves a long-poll cancels it here and, through the
        # chain, upstream (otherwise every relay would keep polling for it until its deadline)
        self._runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=1.0, handler_cancellation=True,
                                     logger=request_log())
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        server = site._server
        assert isinstance(server, asyncio.base_events.Server)
        self.port = server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        """Graceful stop: refuse new connections, close idle ones, wait briefly for the rest."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def kill(self) -> None:
        """Abrupt stop (fault tests): drop every open connection mid-response, then clean up."""
        if self._runner is not None and self._runner.server is not None:
            for handler in list(self._runner.server.connections):
                handler.force_close()
                if handler.transport is not None:
                    handler.transport.abort()
        await self.stop()

    async def __aenter__(self) -> RelayServer:
        return await self.start()

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        await self.stop()


class BackgroundRelay:
    """A :class:`RelayServer` on its own event loop in a daemon thread; ``close()`` joins it."""

    def __init__(self, upstream: str | ObjectStore, config: RelayConfig, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="deltarl-relay", daemon=True)
        self._thread.start()
        self.server: RelayServer | None = None  # built inside the loop
        fut: Future[RelayServer] = asyncio.run_coroutine_threadsafe(self._start(upstream, config, kwargs), self._loop)
        self.server = fut.result(timeout=30)
        self.url = self.server.url

    async def _start(self, upstream: str | ObjectStore, config: RelayConfig, kwargs: dict[str, Any]) -> RelayServer:
        return await RelayServer(upstream, config, **kwargs).start()

    def counters(self) -> dict[str, float]:
        assert self.server is not None
        return asyncio.run_coroutine_threadsafe(_call(self.server.counters), self._loop).result(timeout=30)

    def close(self) -> None:
        if self.server is not None:
            server, self.server = self.server, None
            asyncio.run_coroutine_threadsafe(server.stop(), self._loop).result(timeout=30)
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
        if not self._loop.is_closed():
            self._loop.close()

    def __enter__(self) -> BackgroundRelay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"BackgroundRelay({self.url})"


async def _call(fn: Any) -> Any:
    return fn()
