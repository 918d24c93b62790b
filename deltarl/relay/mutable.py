"""Mutable objects (``<run>/HEAD``): reads coalesced across pollers, and long-polls for a change.

A thousand actors polling HEAD cost about one upstream read per ``head_ttl_s``: a value fetched
within that window is shared, and a read already in flight is joined rather than repeated.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from deltarl.errors import ObjectNotFound
from deltarl.relay.config import RelayConfig
from deltarl.relay.metrics import RelayMetrics
from deltarl.storage.aio import AsyncSource


@dataclass
class Mutable:
    """One read of a mutable key."""

    data: bytes | None  # None: the object does not exist (yet)
    etag: str
    fetched_at: float


class MutableObjects:
    """Coalesced reads of mutable keys. Lives in one event loop."""

    def __init__(self, upstream: AsyncSource, config: RelayConfig, metrics: RelayMetrics) -> None:
        self.upstream = upstream
        self.config = config
        self.metrics = metrics
        self._mutable: dict[str, Mutable] = {}
        self._mutable_inflight: dict[str, asyncio.Future[Mutable]] = {}

    def forget(self, key: str) -> None:
        """Drop a cached value (after a push through this relay)."""
        self._mutable.pop(key, None)

    async def get(self, key: str, *, max_age: float | None = None) -> Mutable:
        """The current value, shared by every caller within ``head_ttl_s`` (one upstream read)."""
        ttl = self.config.head_ttl_s if max_age is None else max_age
        cur = self._mutable.get(key)
        if cur is not None and time.monotonic() - cur.fetched_at < ttl:
            self.metrics.head_coalesced.inc()
            return cur
        fut = self._mutable_inflight.get(key)
        if fut is not None:
            self.metrics.head_coalesced.inc()
            return await asyncio.shield(fut)
        fut = self._mutable_inflight[key] = asyncio.get_running_loop().create_future()
        try:
            self.metrics.upstream_requests.labels("get").inc()
            try:
                data, etag = await self.upstream.get_with_etag(key)
                value = Mutable(data, etag, time.monotonic())
            except ObjectNotFound:
                value = Mutable(None, "", time.monotonic())
            self._mutable[key] = value
            fut.set_result(value)
            return value
        except BaseException as err:
            if isinstance(err, asyncio.CancelledError):
                fut.cancel()
            else:
                fut.set_exception(err)
                fut.exception()  # mark retrieved: callers that shared it re-raise it themselves
            raise
        finally:
            del self._mutable_inflight[key]

    async def wait(self, key: str, *, etag: str | None, wait: float) -> Mutable:
        """The value once its ETag differs from ``etag`` (or once it exists), or the same after ``wait``."""
        deadline = time.monotonic() + min(wait, self.config.max_wait_s)
        while True:
            value = await self.get(key)
            changed = value.data is not None and (etag is None or value.etag != etag)
            left = deadline - time.monotonic()
            if changed or left <= 0:
                return value
            self.metrics.waiters.inc()
            try:
                next_at = value.fetched_at + max(self.config.head_ttl_s, self.config.poll_interval_s)
                await asyncio.sleep(max(0.001, min(left, next_at - time.monotonic())))
            finally:
                self.metrics.waiters.dec()
