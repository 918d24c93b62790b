"""In-memory object store: a dict behind a lock, for tests and single-process demos."""

from __future__ import annotations

import bisect
import itertools
import threading
from collections.abc import Iterator

from deltarl.errors import ObjectExists, ObjectNotFound, PreconditionFailed
from deltarl.storage.keys import clamp_range, etag_of, validate_key, validate_prefix
from deltarl.storage.store import ObjectInfo, ObjectStore

_ids = itertools.count()


class MemoryStore(ObjectStore):
    """Objects held in a dict, every operation atomic under one lock.

    Each instance is its own namespace: two ``MemoryStore()`` never share objects (there is no
    process-wide registry). ETags are the MD5 hex of the content, as for a single-part S3 PUT.
    """

    def __init__(self, name: str | None = None) -> None:
        self.url = f"memory://{name if name is not None else f'store-{next(_ids)}'}"
        self._objects: dict[str, tuple[bytes, str]] = {}
        self._lock = threading.Lock()

    def _entry(self, key: str) -> tuple[bytes, str]:
        try:
            return self._objects[validate_key(key)]
        except KeyError:
            raise ObjectNotFound(f"{self.url}: no object {key!r}") from None

    def get(self, key: str) -> bytes:
        with self._lock:
            return self._entry(key)[0]

    def get_range(self, key: str, start: int, end: int | None = None) -> bytes:
        with self._lock:
            data = self._entry(key)[0]
        lo, hi = clamp_range(key, start, end, len(data))
        return data[lo:hi]

    def head(self, key: str) -> ObjectInfo:
        with self._lock:
            data, etag = self._entry(key)
        return ObjectInfo(key=key, size=len(data), etag=etag)

    def put(self, key: str, data: bytes) -> str:
        validate_key(key)
        data, etag = bytes(data), etag_of(data)
        with self._lock:
            self._objects[key] = (data, etag)
        return etag

    def put_if_absent(self, key: str, data: bytes) -> str:
        validate_key(key)
        data, etag = bytes(data), etag_of(data)
        with self._lock:
            if key in self._objects:
                raise ObjectExists(f"{self.url}: object {key!r} already exists")
            self._objects[key] = (data, etag)
        return etag

    def cas(self, key: str, data: bytes, expected_etag: str | None) -> str:
        validate_key(key)
        data, etag = bytes(data), etag_of(data)
        with self._lock:
            current = self._objects.get(key)
            if expected_etag is None and current is not None:
                raise PreconditionFailed(f"{self.url}: {key!r} exists (expected absent)")
            if expected_etag is not None:
                if current is None:
                    raise ObjectNotFound(f"{self.url}: no object {key!r} to compare-and-swap")
                if current[1] != expected_etag:
                    raise PreconditionFailed(
                        f"{self.url}: {key!r} has ETag {current[1]}, expected {expected_etag}"
                    )
            self._objects[key] = (data, etag)
        return etag

    def exists(self, key: str) -> bool:
        validate_key(key)
        with self._lock:
            return key in self._objects

    def list(self, prefix: str = "") -> Iterator[str]:
        validate_prefix(prefix)
        with self._lock:
            keys = sorted(self._objects)
        yield from itertools.takewhile(
            lambda k: k.startswith(prefix), keys[bisect.bisect_left(keys, prefix) :]
        )

    def delete(self, key: str) -> None:
        validate_key(key)
        with self._lock:
            self._objects.pop(key, None)
