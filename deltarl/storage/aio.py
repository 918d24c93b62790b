"""One async view of "where the bytes come from": an object store (called in threads) or a relay (HTTP).

The actor's fetcher reads through it (relays in order, then the origin) and so does a relay's
upstream (a store, or another relay when relays are chained). Both sides see the same calls:

* ``head(key, wait=)`` and ``get_range(key, start, end, wait=)``: with ``wait`` > 0 a missing
  object is waited for up to ``wait`` seconds (a relay holds the request; a store is polled),
  then ``ObjectNotFound``. ``stream_range`` yields the same bytes as they arrive.
* ``get_mutable(key, etag=, wait=)``: a small mutable object (a run's HEAD) with **the ETag of
  exactly the bytes returned** — the ETag a conditional write (``If-Match``) is checked against —
  or ``None`` if it still has ``etag`` after ``wait``. A missing object is waited for too.
* The writes a relay forwards: ``put`` (plain or conditional), ``delete``, ``list``.

:func:`make_async_source` builds one from a store, a store URL, or a relay URL (``http(s)://``).
"""

from __future__ import annotations

import abc
import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from deltarl.errors import ObjectNotFound, TransientStoreError
from deltarl.storage.http_client import RelayClient
from deltarl.storage.keys import etag_of
from deltarl.storage.store import ObjectInfo, ObjectStore

T = TypeVar("T")

#: Reads of a mutable object retried while a concurrent write lands between its HEAD and its GET.
MUTABLE_READ_ATTEMPTS = 5


class AsyncSource(abc.ABC):
    """An async, read-mostly view of one store or relay."""

    #: Where the bytes come from (a store URL or a relay's base URL), for logs and errors.
    url: str

    @abc.abstractmethod
    async def head(self, key: str, *, wait: float = 0.0) -> ObjectInfo:
        """Size and ETag; ``ObjectNotFound`` if still missing after ``wait`` seconds."""

    @abc.abstractmethod
    async def get_range(
        self, key: str, start: int, end: int | None, *, wait: float = 0.0, unverified: bool = False
    ) -> bytes:
        """Bytes ``[start, end)`` (``end=None``: to the end); a missing object is waited for up to ``wait``."""

    async def stream_range(self, key: str, start: int, end: int, *, unverified: bool = False) -> AsyncIterator[bytes]:
        """Bytes ``[start, end)`` in order, as they arrive (may end short: the caller checks)."""
        yield await self.get_range(key, start, end, unverified=unverified)

    @abc.abstractmethod
    async def get_mutable(self, key: str, *, etag: str | None = None, wait: float = 0.0) -> tuple[bytes, str] | None:
        """A mutable object and the ETag of exactly those bytes; ``None`` if it still has ``etag`` after ``wait``."""

    async def get_with_etag(self, key: str) -> tuple[bytes, str]:
        """The current bytes of a mutable object and their ETag (``ObjectNotFound`` if missing)."""
        got = await self.get_mutable(key)
        if got is None:  # only an answer to If-None-Match may be "unchanged", and none was sent
            raise TransientStoreError(f"{self.url}: {key!r} answered 'not modified' to an unconditional read")
        return got

    @abc.abstractmethod
    async def put(self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        """Write, plainly or conditionally (``If-None-Match: *`` / ``If-Match``); return the ETag."""

    @abc.abstractmethod
    async def delete(self, key: str) -> None: ...

    @abc.abstractmethod
    async def list(self, prefix: str) -> list[str]: ...

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""


class StoreSource(AsyncSource):
    """An :class:`ObjectStore`; blocking calls run in worker threads, waits poll every ``poll_interval_s``."""

    def __init__(self, store: ObjectStore, *, poll_interval_s: float = 0.05) -> None:
        self.store = store
        self.url = store.url
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

    async def head(self, key: str, *, wait: float = 0.0) -> ObjectInfo:
        return await self._polling(lambda: self.store.head(key), wait)

    async def get_range(
        self, key: str, start: int, end: int | None, *, wait: float = 0.0, unverified: bool = False
    ) -> bytes:
        return await self._polling(lambda: self.store.get_range(key, start, end), wait)

    def _read_mutable(self, key: str) -> tuple[bytes, str]:
        """The bytes and the store's ETag of exactly them (a write may land between HEAD and GET)."""
        for _ in range(MUTABLE_READ_ATTEMPTS):
            info = self.store.head(key)
            data = self.store.get(key)
            if etag_of(data) == info.etag or self.store.head(key).etag == info.etag:
                return data, info.etag
        raise TransientStoreError(f"{self.url}: {key!r} kept changing while being read")

    async def get_mutable(self, key: str, *, etag: str | None = None, wait: float = 0.0) -> tuple[bytes, str] | None:
        deadline = time.monotonic() + wait
        while True:
            try:
                data, current = await asyncio.to_thread(self._read_mutable, key)
                if etag is None or current != etag:
                    return data, current
            except ObjectNotFound:
                if time.monotonic() >= deadline:
                    raise
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            await asyncio.sleep(min(self.poll_interval_s, left))

    async def put(self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        if if_match is not None:
            return await asyncio.to_thread(self.store.cas, key, data, if_match)
        if if_none_match:
            return await asyncio.to_thread(self.store.put_if_absent, key, data)
        return await asyncio.to_thread(self.store.put, key, data)

    async def delete(self, key: str) -> None:
        await asyncio.to_thread(self.store.delete, key)

    async def list(self, prefix: str) -> list[str]:
        return await asyncio.to_thread(lambda: list(self.store.list(prefix)))


class RelaySource(AsyncSource):
    """A relay over HTTP (:class:`RelayClient`): waits are held by the relay, not polled."""

    def __init__(self, url: str, *, connections: int = 8, read_timeout_s: float = 60.0, token: str | None = None) -> None:
        self.client = RelayClient(url, connections=connections, read_timeout_s=read_timeout_s, token=token)
        self.url = self.client.base_url

    async def head(self, key: str, *, wait: float = 0.0) -> ObjectInfo:
        return await self.client.head(key, wait=wait or None)

    async def get_range(
        self, key: str, start: int, end: int | None, *, wait: float = 0.0, unverified: bool = False
    ) -> bytes:
        return await self.client.get_range(key, start, end, wait=wait or None, unverified=unverified)

    async def stream_range(self, key: str, start: int, end: int, *, unverified: bool = False) -> AsyncIterator[bytes]:
        async for chunk in self.client.stream(key, start, end, unverified=unverified):
            yield chunk

    async def get_mutable(self, key: str, *, etag: str | None = None, wait: float = 0.0) -> tuple[bytes, str] | None:
        return await self.client.get_mutable(key, etag=etag, wait=wait or None)

    async def put(self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        return await self.client.put(key, data, if_none_match=if_none_match, if_match=if_match)

    async def delete(self, key: str) -> None:
        await self.client.delete(key)

    async def list(self, prefix: str) -> list[str]:
        return await self.client.list(prefix)

    async def close(self) -> None:
        await self.client.close()


def make_async_source(
    source: str | ObjectStore | AsyncSource,
    *,
    connections: int = 8,
    read_timeout_s: float = 60.0,
    token: str | None = None,
    poll_interval_s: float = 0.05,
) -> AsyncSource:
    """An async source from a relay URL (``http(s)://``), a store, any other store URL, or a ready one.

    Args:
        source: what to read from.
        connections: persistent HTTP connections to a relay (long-polls hold one each).
        read_timeout_s: how long a relay response may stall before it counts as failed.
        token: bearer token sent to a relay (needed for the writes it forwards).
        poll_interval_s: how often a wait on a store asks again.

    Returns:
        ``source`` itself if it already is an :class:`AsyncSource`, else a new one.
    """
    if isinstance(source, AsyncSource):
        return source
    if isinstance(source, ObjectStore):
        return StoreSource(source, poll_interval_s=poll_interval_s)
    if source.startswith(("http://", "https://")):
        return RelaySource(source, connections=connections, read_timeout_s=read_timeout_s, token=token)
    from deltarl.storage.open import open_store

    return StoreSource(open_store(source), poll_interval_s=poll_interval_s)
