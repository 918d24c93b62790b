"""Where a relay pulls from: an object store (called in threads) or another relay (over HTTP).

Both look the same to the relay: async ``head``, ``get_range`` (and ``stream_range``, the same
bytes as they arrive), ``get_with_etag`` (a mutable object with the ETag of exactly those bytes),
``wait_head`` (held until a missing object lands), and the writes a push forwards (``put``,
``put_if_absent``, ``cas``, ``delete``, ``list``).
"""

from __future__ import annotations

import abc
import asyncio
import time
from collections.abc import AsyncIterator

from deltarl.errors import ObjectNotFound, TransientStoreError
from deltarl.storage.http_client import RelayClient
from deltarl.storage.keys import etag_of
from deltarl.storage.store import ObjectInfo, ObjectStore


class Upstream(abc.ABC):
    """The async source of a relay."""

    url: str

    @abc.abstractmethod
    async def head(self, key: str) -> ObjectInfo:
        """Size and ETag; ``ObjectNotFound`` if missing."""

    @abc.abstractmethod
    async def wait_head(self, key: str, timeout: float) -> ObjectInfo:
        """Like ``head`` but held up to ``timeout`` seconds while the object is missing."""

    @abc.abstractmethod
    async def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)``."""

    async def stream_range(self, key: str, start: int, end: int) -> AsyncIterator[bytes]:
        """Bytes ``[start, end)`` in order, as they arrive (may end short: the caller checks)."""
        yield await self.get_range(key, start, end)

    @abc.abstractmethod
    async def get_with_etag(self, key: str) -> tuple[bytes, str]:
        """A (small, mutable) object's bytes and the ETag of exactly those bytes."""

    @abc.abstractmethod
    async def put(self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        """Write, plainly or conditionally (``If-None-Match: *`` / ``If-Match``); return the ETag."""

    @abc.abstractmethod
    async def delete(self, key: str) -> None: ...

    @abc.abstractmethod
    async def list(self, prefix: str) -> list[str]: ...

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""


class StoreUpstream(Upstream):
    """A relay over an :class:`ObjectStore`; blocking calls run in worker threads."""

    def __init__(self, store: ObjectStore, *, poll_interval_s: float = 0.05) -> None:
        self.store = store
        self.url = store.url
        self.poll_interval_s = poll_interval_s

    async def head(self, key: str) -> ObjectInfo:
        return await asyncio.to_thread(self.store.head, key)

    async def wait_head(self, key: str, timeout: float) -> ObjectInfo:
        deadline = time.monotonic() + timeout
        while True:
            try:
                return await self.head(key)
            except ObjectNotFound:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                await asyncio.sleep(min(self.poll_interval_s, left))

    async def get_range(self, key: str, start: int, end: int) -> bytes:
        return await asyncio.to_thread(self.store.get_range, key, start, end)

    async def get_with_etag(self, key: str) -> tuple[bytes, str]:
        def read() -> tuple[bytes, str]:
            for _ in range(5):  # a concurrent CAS can land between head and get: retry until they agree
                info = self.store.head(key)
                data = self.store.get(key)
                if etag_of(data) == info.etag or self.store.head(key).etag == info.etag:
                    return data, info.etag
            raise TransientStoreError(f"{self.url}: {key!r} kept changing while being read")

        return await asyncio.to_thread(read)

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


class HTTPUpstream(Upstream):
    """A relay over another relay (chaining): long-polls are passed on, not polled."""

    def __init__(self, base_url: str, *, token: str | None = None, connections: int = 8) -> None:
        self.client = RelayClient(base_url, token=token, connections=connections)
        self.url = self.client.base_url

    async def head(self, key: str) -> ObjectInfo:
        return await self.client.head(key)

    async def wait_head(self, key: str, timeout: float) -> ObjectInfo:
        return await self.client.head(key, wait=timeout)

    # Bytes from the upstream relay come unverified: this relay checks them against the manifest
    # itself, and may pull speculatively before a manifest exists.
    async def get_range(self, key: str, start: int, end: int) -> bytes:
        return await self.client.get_range(key, start, end, unverified=True)

    async def stream_range(self, key: str, start: int, end: int) -> AsyncIterator[bytes]:
        async for chunk in self.client.stream(key, start, end, unverified=True):
            yield chunk

    async def get_with_etag(self, key: str) -> tuple[bytes, str]:
        got = await self.client.get_mutable(key)
        assert got is not None  # no If-None-Match was sent
        return got

    async def put(self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        return await self.client.put(key, data, if_none_match=if_none_match, if_match=if_match)

    async def delete(self, key: str) -> None:
        await self.client.delete(key)

    async def list(self, prefix: str) -> list[str]:
        return await self.client.list(prefix)

    async def close(self) -> None:
        await self.client.close()


def make_upstream(
    upstream: str | ObjectStore, *, token: str | None = None, poll_interval_s: float = 0.05, connections: int = 32
) -> Upstream:
    """An upstream from a store object, an ``http(s)://`` relay URL, or any store URL."""
    if isinstance(upstream, ObjectStore):
        return StoreUpstream(upstream, poll_interval_s=poll_interval_s)
    if upstream.startswith(("http://", "https://")):
        return HTTPUpstream(upstream, token=token, connections=connections)
    from deltarl.storage.open import open_store

    return StoreUpstream(open_store(upstream), poll_interval_s=poll_interval_s)
