"""Where an actor's fetcher reads from: a relay over HTTP, or an object store (the origin).

Both present the same async calls (``get_range`` with an optional long-poll ``wait``, ``head``,
``get_mutable``) so the fetcher can fail over from one to the next without caring which is which.
"""

from __future__ import annotations

import abc
import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

from deltarl.errors import ObjectNotFound
from deltarl.storage.http_client import RelayClient
from deltarl.storage.keys import etag_of
from deltarl.storage.store import ObjectInfo, ObjectStore

T = TypeVar("T")


class Source(abc.ABC):
    """One place objects can be read from."""

    name: str

    @abc.abstractmethod
    async def get_range(self, key: str, start: int, end: int | None, *, wait: float = 0.0, unverified: bool = False) -> bytes:
        """Bytes ``[start, end)`` (``end=None``: to the end, the whole object when ``start == 0``).
        ``unverified``: the caller checks the bytes itself (a relay then serves a segment no committed
        manifest names yet, instead of holding it until one does)."""

    @abc.abstractmethod
    async def head(self, key: str, *, wait: float = 0.0) -> ObjectInfo: ...

    @abc.abstractmethod
    async def get_mutable(self, key: str, *, etag: str | None = None, wait: float = 0.0) -> tuple[bytes, str] | None:
        """A mutable object with its ETag; ``None`` if it still has ``etag`` after ``wait``."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""


class RelaySource(Source):
    """A relay: ``connections`` persistent HTTP connections, long-polls answered by the relay."""

    def __init__(self, url: str, *, connections: int, read_timeout_s: float, token: str | None = None) -> None:
        self.name = url
        self.client = RelayClient(url, connections=connections, read_timeout_s=read_timeout_s, token=token)

    async def get_range(self, key: str, start: int, end: int | None, *, wait: float = 0.0, unverified: bool = False) -> bytes:
        return await self.client.get_range(key, start, end, wait=wait or None, unverified=unverified)

    async def head(self, key: str, *, wait: float = 0.0) -> ObjectInfo:
        return await self.client.head(key, wait=wait or None)

    async def get_mutable(self, key: str, *, etag: str | None = None, wait: float = 0.0) -> tuple[bytes, str] | None:
        return await self.client.get_mutable(key, etag=etag, wait=wait or None)

    async def close(self) -> None:
        await self.client.close()


class StoreSource(Source):
    """An object store (usually the origin); blocking calls run in threads, long-polls poll."""

    def __init__(self, store: ObjectStore, *, poll_interval_s: float = 0.1) -> None:
        self.store = store
        self.name = store.url
        self.poll_interval_s = poll_interval_s

    async def _polling(self, fn: Callable[[], T], wait: float) -> T:
        deadline = time.monotonic() + wait
        while True:
            try:
                return await asyncio.to_thread(fn)
            except ObjectNotFound:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                await asyncio.sleep(min(self.poll_interval_s, left))

    async def get_range(self, key: str, start: int, end: int | None, *, wait: float = 0.0, unverified: bool = False) -> bytes:
        return await self._polling(lambda: self.store.get_range(key, start, end), wait)

    async def head(self, key: str, *, wait: float = 0.0) -> ObjectInfo:
        return await self._polling(lambda: self.store.head(key), wait)

    async def get_mutable(self, key: str, *, etag: str | None = None, wait: float = 0.0) -> tuple[bytes, str] | None:
        deadline = time.monotonic() + wait
        while True:
            try:
                data: bytes = await asyncio.to_thread(self.store.get, key)
                current = etag_of(data)
                if etag is None or current != etag:
                    return data, current
            except ObjectNotFound:
                if time.monotonic() >= deadline:
                    raise
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            await asyncio.sleep(min(self.poll_interval_s, left))


def make_source(source: str | ObjectStore | Source, *, connections: int, read_timeout_s: float, token: str | None = None) -> Source:
    """A source from a relay URL (``http(s)://``), a store, a store URL, or a ready ``Source``."""
    if isinstance(source, Source):
        return source
    if isinstance(source, ObjectStore):
        return StoreSource(source)
    if source.startswith(("http://", "https://")):
        return RelaySource(source, connections=connections, read_timeout_s=read_timeout_s, token=token)
    from deltarl.storage.open import open_store

    return StoreSource(open_store(source))
