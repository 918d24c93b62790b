"""One async view of "where the bytes come from": an object store (called in threads) or a relay (HTTP).

The actor's fetcher reads through it (relays in order, then the origin) and so does a relay's
upstream (a store, or another relay when relays are chained). Both sides see the same calls:

* ``head(key, wait=)`` and ``get_range(key, start, end, wait=)``: with ``wait`` > 0 a missing
  object is waited for up to ``wait`` seconds (a relay holds the request; a store is polled),
  then ``ObjectNotFound``. ``stream_range`` yields the same bytes as they arrive.
* ``get_mutable(key, etag=, wait=)``: a small mutable object (a run's HEAD) with **the ETag of
  exactly the bytes returned** — the ETag a conditional write (``If-Match``) is checked against —
  or ``None`` if it still has ``etag`` after ``wait``. A missing object is waited for too.
* No busy polling: nginx, plain S3 and a store answer "not found" at once where a deltarl relay
  holds the request. Whenever a 404 (or an unchanged answer) comes back sooner than the wait asked
  for, the source sleeps before asking again, exponentially longer per key (jittered, 50 ms to
  about a second), and remembers the count across calls until the key is found. A store source
  caps that sleep at its ``poll_interval_s``.
* The writes a relay forwards: ``put`` (plain or conditional), ``delete``, ``list``.

:func:`make_async_source` builds one from a store, a store URL, or a relay URL (``http(s)://``).
"""

from __future__ import annotations

import abc
import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from deltarl.defaults import RELAY_READ_TIMEOUT_S
from deltarl.errors import ObjectNotFound, TransientStoreError
from deltarl.storage.http_client import RelayClient
from deltarl.storage.keys import etag_of
from deltarl.storage.retry import POLL_BACKOFF
from deltarl.storage.store import ObjectInfo, ObjectStore

T = TypeVar("T")

#: Reads of a mutable object retried while a concurrent write lands between its HEAD and its GET.
MUTABLE_READ_ATTEMPTS = 5
#: A "not found" this much sooner than the wait asked for was not held by the server: back off.
_EARLY_S = 0.05
_MAX_TRACKED = 4096


class AsyncSource(abc.ABC):
    """An async, read-mostly view of one store or relay."""

    #: Where the bytes come from (a store URL or a relay's base URL), for logs and errors.
    url: str

    #: Per key: how many answers in a row came back "not yet" sooner than the wait asked for.
    _misses: dict[str, int]

    def _miss_counts(self) -> dict[str, int]:
        misses = self.__dict__.get("_misses")
        if misses is None or len(misses) >= _MAX_TRACKED:
            misses = self.__dict__["_misses"] = {}
        return misses

    async def _back_off(self, key: str, left: float, *, cap: float | None = None) -> None:
        """Sleep before asking about ``key`` again: longer after each early miss (jittered, from
        50 ms up to about a second, :data:`~deltarl.storage.retry.POLL_BACKOFF`; at most ``cap``
        and ``left``)."""
        misses = self._miss_counts()
        count = misses.get(key, 0)
        misses[key] = count + 1
        delay = POLL_BACKOFF.delay(count)
        await asyncio.sleep(min(delay if cap is None else min(delay, cap), left))

    async def _long_poll(
        self, key: str, wait: float, call: Callable[[float], Awaitable[T]], *, cap: float | None = None
    ) -> T:
        """``call(wait_left)`` until it returns or ``wait`` runs out. A "not found" that comes back
        sooner than the wait asked for (nginx, plain S3, a store: nothing held the request) backs
        off first, so an idle reader never spins."""
        deadline = time.monotonic() + wait
        while True:
            try:
                value = await call(max(0.0, deadline - time.monotonic()))
            except ObjectNotFound:
                left = deadline - time.monotonic()
                if left <= _EARLY_S:
                    raise
                await self._back_off(key, left, cap=cap)
                continue
            self._miss_counts().pop(key, None)
            return value

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

    async def _polling(self, key: str, fn: Callable[[], T], wait: float) -> T:
        return await self._long_poll(key, wait, lambda _left: asyncio.to_thread(fn), cap=self.poll_interval_s)

    async def head(self, key: str, *, wait: float = 0.0) -> ObjectInfo:
        return await self._polling(key, lambda: self.store.head(key), wait)

    async def get_range(
        self, key: str, start: int, end: int | None, *, wait: float = 0.0, unverified: bool = False
    ) -> bytes:
        return await self._polling(key, lambda: self.store.get_range(key, start, end), wait)

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
            data, current = await self._polling(key, lambda: self._read_mutable(key), max(0.0, deadline - time.monotonic()))
            if etag is None or current != etag:
                return data, current
            left = deadline - time.monotonic()
            if left <= _EARLY_S:
                return None
            await self._back_off(key, left, cap=self.poll_interval_s)

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

    def __init__(self, url: str, *, connections: int = 8, read_timeout_s: float = RELAY_READ_TIMEOUT_S, token: str | None = None) -> None:
        self.client = RelayClient(url, connections=connections, read_timeout_s=read_timeout_s, token=token)
        self.url = self.client.base_url

    async def head(self, key: str, *, wait: float = 0.0) -> ObjectInfo:
        return await self._long_poll(key, wait, lambda w: self.client.head(key, wait=w or None))

    async def get_range(
        self, key: str, start: int, end: int | None, *, wait: float = 0.0, unverified: bool = False
    ) -> bytes:
        return await self._long_poll(
            key, wait, lambda w: self.client.get_range(key, start, end, wait=w or None, unverified=unverified)
        )

    async def stream_range(self, key: str, start: int, end: int, *, unverified: bool = False) -> AsyncIterator[bytes]:
        async for chunk in self.client.stream(key, start, end, unverified=unverified):
            yield chunk

    async def get_mutable(self, key: str, *, etag: str | None = None, wait: float = 0.0) -> tuple[bytes, str] | None:
        """A relay holds the request while the object keeps ``etag``; nginx or S3 answers at once
        (304), so an early unchanged answer is asked again after the same backoff as a 404."""
        deadline = time.monotonic() + wait
        while True:
            got = await self._long_poll(
                key, max(0.0, deadline - time.monotonic()),
                lambda w: self.client.get_mutable(key, etag=etag, wait=w or None),
            )
            left = deadline - time.monotonic()
            if got is not None or left <= _EARLY_S:
                return got
            await self._back_off(key, left)

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
    read_timeout_s: float = RELAY_READ_TIMEOUT_S,
    token: str | None = None,
    poll_interval_s: float = 0.05,
) -> AsyncSource:
    """An async source from a relay URL (``http(s)://``), a store, any other store URL, or a ready one.

    Args:
        source: what to read from (a local store path must name an existing folder: ``StoreNotFound``).
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

    return StoreSource(open_store(source, must_exist=True), poll_interval_s=poll_interval_s)
