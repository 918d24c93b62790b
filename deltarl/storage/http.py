"""``HTTPStore``: the :class:`ObjectStore` contract over a relay's HTTP API (synchronous, urllib3).

Reads go through the relay (and so through its cache); writes are pushes the relay forwards to its
upstream store, so they need the relay's bearer token. ``put_if_absent`` sends
``If-None-Match: *`` and ``cas`` sends ``If-Match``; the relay maps those onto its upstream's real
conditional writes, so the guarantees are the upstream's. Listing and deletion are forwarded too.

Idempotent requests (reads, plain PUT, DELETE) are retried by :mod:`deltarl.storage.retry`;
conditional writes are not retried after a dropped connection, since the first attempt may have
landed and a retry would then report a false conflict.

For asyncio code use :class:`deltarl.storage.http_client.RelayClient` instead.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import urllib3

from deltarl.defaults import RELAY_READ_TIMEOUT_S
from deltarl.errors import InvalidRange, ObjectExists, PreconditionFailed, TransientStoreError
from deltarl.storage.http_client import network_error, raise_for_status
from deltarl.storage.keys import check_range_args, strip_etag, validate_key, validate_prefix
from deltarl.storage.retry import NO_RETRY, RetryPolicy
from deltarl.storage.store import ObjectInfo, ObjectStore


class HTTPStore(ObjectStore):
    """An object store served by a deltarl relay (or any server speaking its small HTTP API)."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        connections: int = 8,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = RELAY_READ_TIMEOUT_S,
        retry: RetryPolicy | None = None,
    ) -> None:
        self.url = base_url.rstrip("/")
        self.token = token
        self.retry = retry if retry is not None else RetryPolicy()
        self._pool = urllib3.PoolManager(
            num_pools=4,
            maxsize=connections,
            retries=False,
            timeout=urllib3.Timeout(connect=connect_timeout_s, read=read_timeout_s),
        )

    def close(self) -> None:
        self._pool.clear()

    def __repr__(self) -> str:
        return f"HTTPStore({self.url!r})"

    # --- transport ------------------------------------------------------------------------------

    def _request(
        self,
        method: str,
        key: str | None,
        *,
        headers: dict[str, str] | None = None,
        body: bytes | None = None,
        query: str = "",
        retry: RetryPolicy | None = None,
    ) -> urllib3.BaseHTTPResponse:
        url = self.url + "/" + ("" if key is None else quote(key, safe="/-_.~")) + query
        hdrs = dict(headers or {})
        if self.token:
            hdrs["Authorization"] = f"Bearer {self.token}"

        def once() -> urllib3.BaseHTTPResponse:
            try:
                resp = self._pool.request(method, url, headers=hdrs, body=body, preload_content=True, redirect=False)
            except urllib3.exceptions.HTTPError as err:
                raise network_error(f"{method} {url}", self.url, err) from err
            if resp.status >= 500 or resp.status == 429:
                raise_for_status(resp.status, f"{method} {url}", resp.data.decode(errors="replace"), resp.headers)
            return resp

        policy = retry or self.retry
        try:
            return policy.call(once, f"{method} {url}")
        except TransientStoreError as err:
            if policy.attempts == 1:
                raise
            raise TransientStoreError(f"{err} (gave up after {policy.attempts} attempts)") from err

    # --- reads ----------------------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        validate_key(key)
        resp = self._request("GET", key)
        if resp.status != 200:
            raise_for_status(resp.status, f"GET {self.url}/{key}", resp.data.decode(errors="replace"))
        return bytes(resp.data)

    def get_range(self, key: str, start: int, end: int | None = None) -> bytes:
        validate_key(key)
        check_range_args(key, start, end)
        if end is not None and end == start:
            if start > self.head(key).size:
                raise InvalidRange(f"{key}: range start {start} is beyond the object's end")
            return b""
        rng = f"bytes={start}-" + ("" if end is None else str(end - 1))
        resp = self._request("GET", key, headers={"Range": rng})
        if resp.status == 206:
            return bytes(resp.data)
        if resp.status == 200:  # range ignored by the server: cut it here
            return bytes(resp.data[start:end])
        if resp.status == 416:  # start at or past the end: empty when exactly at the end
            if start == self.head(key).size:
                return b""
            raise InvalidRange(f"{key}: range [{start}, {end}) is beyond the object's end")
        raise_for_status(resp.status, f"GET {self.url}/{key} {rng}", resp.data.decode(errors="replace"))

    def head(self, key: str) -> ObjectInfo:
        validate_key(key)
        resp = self._request("HEAD", key)
        if resp.status != 200:
            raise_for_status(resp.status, f"HEAD {self.url}/{key}")
        return ObjectInfo(key=key, size=int(resp.headers.get("Content-Length", "0")), etag=strip_etag(resp.headers.get("ETag")))

    def exists(self, key: str) -> bool:
        validate_key(key)
        resp = self._request("HEAD", key)
        if resp.status == 404:
            return False
        if resp.status != 200:
            raise_for_status(resp.status, f"HEAD {self.url}/{key}")
        return True

    def list(self, prefix: str = "") -> Iterator[str]:
        validate_prefix(prefix)
        resp = self._request("GET", None, query="?prefix=" + quote(prefix, safe=""))
        if resp.status != 200:
            raise_for_status(resp.status, f"LIST {self.url} {prefix!r}", resp.data.decode(errors="replace"))
        keys: list[Any] = json.loads(resp.data)["keys"]
        return iter(sorted(str(k) for k in keys))

    # --- writes ---------------------------------------------------------------------------------

    def _put(self, key: str, data: bytes, headers: dict[str, str], retry: RetryPolicy | None) -> tuple[int, str, str]:
        validate_key(key)
        resp = self._request("PUT", key, headers=headers, body=bytes(data), retry=retry)
        return resp.status, strip_etag(resp.headers.get("ETag")), resp.data.decode(errors="replace")

    def put(self, key: str, data: bytes) -> str:
        status, etag, text = self._put(key, data, {}, None)
        if status not in (200, 201):
            raise_for_status(status, f"PUT {self.url}/{key}", text)
        return etag

    def put_if_absent(self, key: str, data: bytes) -> str:
        status, etag, text = self._put(key, data, {"If-None-Match": "*"}, NO_RETRY)
        if status == 412:
            raise ObjectExists(f"{self.url}: object {key!r} already exists")
        if status not in (200, 201):
            raise_for_status(status, f"PUT {self.url}/{key}", text)
        return etag

    def cas(self, key: str, data: bytes, expected_etag: str | None) -> str:
        headers = {"If-None-Match": "*"} if expected_etag is None else {"If-Match": f'"{expected_etag}"'}
        status, etag, text = self._put(key, data, headers, NO_RETRY)
        if status == 412:
            raise PreconditionFailed(f"{self.url}: {key!r} is not at ETag {expected_etag}: {text[:200]}")
        if status not in (200, 201):
            raise_for_status(status, f"PUT {self.url}/{key}", text)
        return etag

    def delete(self, key: str) -> None:
        validate_key(key)
        resp = self._request("DELETE", key)
        if resp.status not in (200, 204, 404):
            raise_for_status(resp.status, f"DELETE {self.url}/{key}", resp.data.decode(errors="replace"))
