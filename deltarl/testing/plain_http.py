"""A plain HTTP object server for tests and benchmarks: serves a store's objects the way nginx or a
public S3 bucket does (``GET``/``HEAD`` with ``Range`` and ``If-None-Match``; a 404 or 304 **at
once**; ``?wait=`` ignored) and counts every request, so a test can check how often a reader asks.
"""

from __future__ import annotations

import asyncio
from collections import Counter

from aiohttp import web

from deltarl.errors import ObjectNotFound
from deltarl.storage.keys import etag_of
from deltarl.storage.store import ObjectStore


class PlainServer:
    """A store over HTTP without long-polls; ``requests`` counts requests by key."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self.requests: Counter[str] = Counter()
        self.url = ""
        self._runner: web.AppRunner | None = None

    @property
    def total(self) -> int:
        return sum(self.requests.values())

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        key = request.match_info["key"]
        self.requests[key] += 1
        try:
            data = await asyncio.to_thread(self.store.get, key)
        except ObjectNotFound:
            return web.Response(status=404, text="not found")
        etag = etag_of(data)
        if request.headers.get("If-None-Match", "").strip('"') == etag:
            return web.Response(status=304, headers={"ETag": f'"{etag}"'})
        status, body = 200, data
        rng = request.http_range
        if rng.start is not None or rng.stop is not None:
            status, body = 206, data[rng]
        return web.Response(status=status, body=b"" if request.method == "HEAD" else body,
                            headers={"ETag": f'"{etag}"', "Content-Length": str(len(body))})

    async def start(self) -> PlainServer:
        app = web.Application()
        app.router.add_get("/{key:.+}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
