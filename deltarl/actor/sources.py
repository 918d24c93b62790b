"""Where an actor's fetcher reads from: a relay over HTTP, or an object store (the origin).

Both present the same async calls (``get_range`` with an optional long-poll ``wait``, ``head``,
``get_mutable``) so the fetcher can fail over from one to the next without caring which is which.

No busy polling: a deltarl relay holds a ``?wait=`` request until the object lands, but nginx, plain
S3 and a store answer 404 at once. Whenever a 404 comes back sooner than the wait asked for, the
source sleeps before asking again, exponentially longer per key (jittered, from 50 ms up to about a
second, :data:`POLL_BACKOFF`), and remembers the count across calls until the key is found. An idle
reader therefore asks about each key it waits for about once a second, and still sees a new object
within about a second of its landing.
"""

from __future__ import annotations

import abc
import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from deltarl.errors import ObjectNotFound
from deltarl.storage.http_client import RelayClient
from deltarl.storage.keys import etag_of
from deltarl.storage.retry import POLL_BACKOFF
from deltarl.storage.store import ObjectInfo, ObjectStore

T = TypeVar("T")

#: A 404 this much sooner than the wait asked for was not held by the server: back off.
_EARLY_S = 0.05
_MAX_TRACKED = 4096


class Source(abc.ABC):
    """One place objects can be read from."""

    name: str

    def __init__(self) -> None:
        #: Per key: how many answers in a row came back "not yet" sooner than the wait asked for.
        self._misses: dict[str, int] = {}

    async def _back_off(self, key: str, left: float) -> None:
        """Sleep before polling ``key`` again (longer after each early miss, at most ``left``)."""
        if len(self._misses) >= _MAX_TRACKED:
            self._misses.clear()
        count = self._misses.get(key, 0)
        self._misses[key] = count + 1
        await asyncio.sleep(min(POLL_BACKOFF.delay(count), left))

    async def _long_poll(self, key: str, wait: float, call: Callable[[float], Awaitable[T]]) -> T:
        """``call(wait_left)`` until it returns or ``wait`` runs out; an early 404 backs off first."""
        deadline = time.monotonic() + wait
        while True:
            try:
                value = await call(max(0.0, deadline - time.monotonic()))
            except ObjectNotFound:
                left = deadline - time.monotonic()
                if left <= _EARLY_S:
                    raise
                await self._back_off(key, left)
                continue
            self._misses.pop(key, None)
            return value

    @abc.abstractmethod
    async def get_range(self, key: str, start: int, end: int | None, *, wait: float = 0.0) -> bytes:
        """Bytes ``[start, end)`` (``end=None``: to the end, the whole object when ``start == 0``)."""

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
        super().__init__()
        self.name = url
        self.client = RelayClient(url, connections=connections, read_timeout_s=read_timeout_s, token=token)

    async def get_range(self, key: str, start: int, end: int | None, *, wait: float = 0.0) -> bytes:
        return await self._long_poll(key, wait, lambda w: self.client.get_range(key, start, end, wait=w or None))

    async def head(self, key: str, *, wait: float = 0.0) -> ObjectInfo:
        return await self._long_poll(key, wait, lambda w: self.client.head(key, wait=w or None))

    async def get_mutable(self, key: str, *, etag: str | None = None, wait: float = 0.0) -> tuple[bytes, str] | None:
        """A relay holds the request while HEAD keeps ``etag``; nginx or S3 answers at once (304),
        so an early unchanged answer is retried after the same backoff as a 404."""
        deadline = time.monotonic() + wait
        while True:
            got = await self._long_poll(key, max(0.0, deadline - time.monotonic()),
                                        lambda w: self.client.get_mutable(key, etag=etag, wait=w or None))
            left = deadline - time.monotonic()
            if got is not None or left <= _EARLY_S:
                return got
            await self._back_off(key, left)

    async def close(self) -> None:
        await self.client.close()


class StoreSource(Source):
    """An object store (usually the origin); blocking calls run in threads, long-polls poll with
    the same backoff as an early 404 from a relay."""

    def __init__(self, store: ObjectStore) -> None:
        super().__init__()
        self.store = store
        self.name = store.url

    async def get_range(self, key: str, start: int, end: int | None, *, wait: float = 0.0) -> bytes:
        return await self._long_poll(key, wait, lambda w: asyncio.to_thread(self.store.get_range, key, start, end))

    async def head(self, key: str, *, wait: float = 0.0) -> ObjectInfo:
        return await self._long_poll(key, wait, lambda w: asyncio.to_thread(self.store.head, key))

    async def get_mutable(self, key: str, *, etag: str | None = None, wait: float = 0.0) -> tuple[bytes, str] | None:
        deadline = time.monotonic() + wait
        while True:
            data: bytes = await self._long_poll(key, max(0.0, deadline - time.monotonic()),
                                                lambda w: asyncio.to_thread(self.store.get, key))
            current = etag_of(data)
            left = deadline - time.monotonic()
            if etag is None or current != etag:
                return data, current
            if left <= _EARLY_S:
                return None
            await self._back_off(key, left)


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
