"""Async HTTP client of the relay API (aiohttp): used by chained relays and by actors' fetchers.

Every object lives at ``<base_url>/<key>``. Status codes map to the store errors: 404
``ObjectNotFound``, 412 ``PreconditionFailed``, 416 ``InvalidRange``, 400 ``InvalidKey``, 5xx and
dropped or truncated connections ``TransientStoreError``. ``wait=`` asks the relay to hold the
request until an object that does not exist yet lands (long-poll).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
from collections.abc import AsyncIterator, Mapping
from types import TracebackType
from typing import NoReturn
from urllib.parse import quote

import aiohttp
import urllib3
from yarl import URL

from deltarl.defaults import RELAY_READ_TIMEOUT_S
from deltarl.errors import (
    IntegrityError,
    InvalidKey,
    InvalidRange,
    ObjectExists,
    ObjectNotFound,
    PreconditionFailed,
    StoreError,
    TransientStoreError,
)
from deltarl.storage.keys import strip_etag, validate_key
from deltarl.storage.store import ObjectInfo

#: Errors of aiohttp and the loop that mean "this connection or server failed; try again/elsewhere".
NETWORK_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)
#: Failures to open a connection at all (urllib3's NewConnectionError is a ConnectTimeoutError).
_CONNECT_ERRORS = (aiohttp.ClientConnectorError, urllib3.exceptions.ConnectTimeoutError, ConnectionRefusedError)


def network_reason(err: BaseException) -> str:
    """Why a request failed on the network, in a few words: the OS error under a client's wrapper
    ("connection refused", "name or service not known"), "timed out", else the error's own text."""
    chain: list[BaseException] = []
    e: BaseException | None = err
    while e is not None and e not in chain and len(chain) < 8:
        chain.append(e)
        e = getattr(e, "os_error", None) or e.__cause__ or e.__context__
    for e in chain:
        if isinstance(e, OSError) and e.errno:
            return os.strerror(e.errno).lower()
        if isinstance(e, OSError) and getattr(e, "strerror", None) and not isinstance(e, StoreError):
            return str(e.strerror).lower()
    if any(isinstance(e, (TimeoutError, asyncio.TimeoutError, urllib3.exceptions.TimeoutError)) for e in chain):
        return "timed out"
    return str(err) or type(err).__name__


def network_error(what: str, base_url: str, err: BaseException) -> TransientStoreError:
    """The one-line error of a request ``what`` to ``base_url`` that failed on the network."""
    if isinstance(err, _CONNECT_ERRORS):
        return TransientStoreError(f"{what}: cannot reach {base_url}: {network_reason(err)}")
    return TransientStoreError(f"{what}: connection to {base_url} failed: {network_reason(err)}")


def object_url(base_url: str, key: str, **query: str) -> URL:
    """The URL of ``key`` under ``base_url`` (key parts percent-encoded, ``/`` kept)."""
    validate_key(key)
    url = URL(base_url.rstrip("/") + "/" + quote(key, safe="/-_.~"), encoded=True)
    return url.with_query(query) if query else url


#: Header of a relay's 502 that is not transient: the upstream's bytes fail their manifest.
INTEGRITY_HEADER = "X-Deltarl-Error"


def raise_for_status(status: int, what: str, body: str = "", headers: Mapping[str, str] | None = None) -> NoReturn:
    """Raise the store error that an HTTP status means (never returns). A relay's 502 marked
    ``X-Deltarl-Error: integrity`` is an IntegrityError: retrying it cannot help."""
    detail = f"{what}: HTTP {status}" + (f" ({body[:200]})" if body else "")
    if headers is not None and headers.get(INTEGRITY_HEADER) == "integrity":
        raise IntegrityError(detail)
    if status == 404:
        raise ObjectNotFound(detail)
    if status == 412:
        raise PreconditionFailed(detail)
    if status == 416:
        raise InvalidRange(detail)
    if status == 400:
        raise InvalidKey(detail)
    if status == 409:
        raise ObjectExists(detail)
    if status >= 500 or status == 429:
        raise TransientStoreError(detail)
    raise StoreError(detail)


class RelayClient:
    """Async client of one relay (or any HTTP server that serves objects at their keys)."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        connections: int = 8,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = RELAY_READ_TIMEOUT_S,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self._connections = connections
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s)
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        """The pooled session (``connections`` persistent connections), created on first use."""
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self._connections, limit_per_host=self._connections)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout, auto_decompress=False)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> RelayClient:
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def _url(self, key: str, wait: float | None = None, unverified: bool = False) -> URL:
        query = {"wait": f"{wait:.3f}"} if wait else {}
        if unverified:
            query["unverified"] = "1"
        return object_url(self.base_url, key, **query)

    # --- reads --------------------------------------------------------------------------------

    async def head(self, key: str, *, wait: float | None = None) -> ObjectInfo:
        """Size and ETag of ``key``; with ``wait``, held until it exists (else ``ObjectNotFound``)."""
        try:
            async with self.session.head(self._url(key, wait)) as resp:
                if resp.status != 200:
                    raise_for_status(resp.status, f"HEAD {self.base_url}/{key}")
                size = int(resp.headers.get("Content-Length", "0"))
                return ObjectInfo(key=key, size=size, etag=strip_etag(resp.headers.get("ETag")))
        except NETWORK_ERRORS as err:
            raise network_error(f"HEAD {self.base_url}/{key}", self.base_url, err) from err

    async def get_range(self, key: str, start: int = 0, end: int | None = None, *, wait: float | None = None,
                        unverified: bool = False) -> bytes:
        """Bytes ``[start, end)`` of ``key``; a short or dropped response is ``TransientStoreError``.
        ``unverified``: a segment no committed manifest names yet, unchecked (the caller checks)."""
        chunks = [c async for c in self.stream(key, start, end, wait=wait, unverified=unverified)]
        return b"".join(chunks)

    async def get(self, key: str, *, wait: float | None = None, unverified: bool = False) -> bytes:
        return await self.get_range(key, 0, None, wait=wait, unverified=unverified)

    async def stream(
        self, key: str, start: int = 0, end: int | None = None, *, wait: float | None = None, chunk_bytes: int = 256 << 10,
        unverified: bool = False,
    ) -> AsyncIterator[bytes]:
        """Yield the bytes of ``[start, end)`` as they arrive; raise if the response ends short."""
        what = f"GET {self.base_url}/{key} [{start}, {end})"
        headers = self._auth()
        if start or end is not None:
            if end is not None and end <= start:
                raise InvalidRange(f"{what}: empty or inverted range")
            headers["Range"] = f"bytes={start}-" + ("" if end is None else str(end - 1))
        try:
            async with self.session.get(self._url(key, wait, unverified), headers=headers) as resp:
                if resp.status not in (200, 206):
                    raise_for_status(resp.status, what, await resp.text(errors="replace"), resp.headers)
                expected = resp.content_length
                skip = start if resp.status == 200 else 0  # server ignored the range
                limit = None if end is None else end - start
                got = 0
                async for chunk in resp.content.iter_chunked(chunk_bytes):
                    if skip:
                        drop = min(skip, len(chunk))
                        chunk, skip = chunk[drop:], skip - drop
                    if limit is not None:
                        chunk = chunk[: max(0, limit - got)]
                    if chunk:
                        got += len(chunk)
                        yield chunk
                if expected is not None and resp.status == 206 and got != expected:
                    raise TransientStoreError(f"{what}: truncated response ({got} of {expected} bytes)")
        except NETWORK_ERRORS as err:
            raise network_error(what, self.base_url, err) from err

    async def get_mutable(self, key: str, *, etag: str | None = None, wait: float | None = None) -> tuple[bytes, str] | None:
        """Read a mutable object (HEAD) with its ETag; ``None`` if still ``etag`` after ``wait``."""
        headers = self._auth()
        if etag:
            headers["If-None-Match"] = f'"{etag}"'
        try:
            async with self.session.get(self._url(key, wait), headers=headers) as resp:
                if resp.status == 304:
                    return None
                if resp.status != 200:
                    raise_for_status(resp.status, f"GET {self.base_url}/{key}")
                return await resp.read(), strip_etag(resp.headers.get("ETag"))
        except NETWORK_ERRORS as err:
            raise network_error(f"GET {self.base_url}/{key}", self.base_url, err) from err

    async def list(self, prefix: str = "") -> list[str]:
        url = URL(self.base_url + "/", encoded=True).with_query({"prefix": prefix})
        try:
            async with self.session.get(url, headers=self._auth()) as resp:
                if resp.status != 200:
                    raise_for_status(resp.status, f"LIST {self.base_url} {prefix!r}")
                return [str(k) for k in json.loads(await resp.read())["keys"]]
        except NETWORK_ERRORS as err:
            raise network_error(f"LIST {self.base_url}", self.base_url, err) from err

    # --- writes -------------------------------------------------------------------------------

    async def put(self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        """PUT (optionally conditional); returns the new ETag. 412 is ``PreconditionFailed``."""
        headers = self._auth()
        if if_none_match:
            headers["If-None-Match"] = "*"
        if if_match is not None:
            headers["If-Match"] = f'"{if_match}"'
        try:
            body = io.BytesIO(data) if len(data) > (1 << 20) else bytes(data)  # aiohttp warns on big raw bytes
            async with self.session.put(self._url(key), data=body, headers=headers) as resp:
                if resp.status not in (200, 201):
                    raise_for_status(resp.status, f"PUT {self.base_url}/{key}", await resp.text(errors="replace"))
                return strip_etag(resp.headers.get("ETag"))
        except NETWORK_ERRORS as err:
            raise network_error(f"PUT {self.base_url}/{key}", self.base_url, err) from err

    async def delete(self, key: str) -> None:
        try:
            async with self.session.delete(self._url(key), headers=self._auth()) as resp:
                if resp.status not in (200, 204, 404):
                    raise_for_status(resp.status, f"DELETE {self.base_url}/{key}")
        except NETWORK_ERRORS as err:
            raise network_error(f"DELETE {self.base_url}/{key}", self.base_url, err) from err
