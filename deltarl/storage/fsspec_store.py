"""A store on any fsspec filesystem (gcs://, az://, hf://, s3fs, fsspec's memory and local ...).

Reads work on every filesystem, so ``replay``, ``inspect``, ``audit`` and ``follow`` accept any
fsspec URL. Publishing needs real conditional writes (``put_if_absent`` and ``cas``, see
:mod:`deltarl.storage.store`), and fsspec has no generic API for them: its ``pipe_file(...,
mode="create")`` is exists-then-write on most filesystems, which two writers can both pass. So
conditional writes are offered only where the filesystem makes them atomic on the server:

* s3fs (``s3://`` through fsspec): ``mode="create"`` sends ``If-None-Match: *`` and ``cas`` passes
  ``IfMatch`` to ``PutObject`` (s3fs 2026.9 forwards it; the server must support S3 conditional
  writes, as AWS S3, MinIO and SeaweedFS do).

Everywhere else ``put_if_absent`` and ``cas`` raise :class:`~deltarl.errors.ConditionalWriteUnsupported`
(so a publisher is refused when it first writes, not when the store is opened); plain ``put`` and
``delete`` work. ETags are the server's where it keeps one (S3), else the content's MD5 (as the
memory and local stores give).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
from collections.abc import Iterator
from typing import Any

from deltarl.errors import (
    ConditionalWriteUnsupported,
    InvalidRange,
    ObjectExists,
    ObjectNotFound,
    PreconditionFailed,
    StoreError,
)
from deltarl.storage.keys import check_range_args, strip_etag, validate_key, validate_prefix
from deltarl.storage.store import ObjectInfo, ObjectStore

#: fsspec filesystem classes (by module and name) whose conditional writes are server-side atomic.
_CONDITIONAL = {("s3fs.core", "S3FileSystem")}


def _is_412(err: BaseException) -> bool:
    cause = err.__cause__ or err.__context__
    response = getattr(cause, "response", None)
    return isinstance(response, dict) and response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 412


class FsspecStore(ObjectStore):
    """An :class:`ObjectStore` rooted at ``url`` on an fsspec filesystem.

    Args:
        url: an fsspec URL (``gcs://bucket/prefix``, ``memory://root``, ``file:///dir``, ...).
        **storage_options: passed to the filesystem (credentials, endpoint, ...).
    """

    def __init__(self, url: str, **storage_options: Any) -> None:
        try:
            from fsspec.core import url_to_fs
        except ImportError as err:  # pragma: no cover - fsspec ships with the base install
            raise StoreError("fsspec is not installed: pip install 'deltarl[fsspec]'") from err
        scheme = url.split("://", 1)[0].lower() if "://" in url else ""
        if scheme in ("file", "local", ""):
            storage_options.setdefault("auto_mkdir", True)  # keys have '/' parts: create their directories
        if scheme in ("s3", "s3a"):  # every object deltarl writes carries its own piece hashes: no CRC pass over the bytes
            config = storage_options.setdefault("config_kwargs", {})
            config.setdefault("request_checksum_calculation", "when_required")
            config.setdefault("response_checksum_validation", "when_required")
        try:
            fs, path = url_to_fs(url, **storage_options)
        except (ImportError, ValueError, OSError) as err:  # missing package, bad URL, unreachable server
            raise StoreError(f"cannot open fsspec filesystem for {url!r}: {err}") from err
        self.fs = fs
        self.url = url
        self.root = str(path).rstrip("/")
        cls = type(fs)
        #: Whether put_if_absent/cas are real conditional writes here (see the module docstring).
        self.conditional_writes = (cls.__module__, cls.__name__) in _CONDITIONAL

    # --- paths ------------------------------------------------------------------------------------

    def _path(self, key: str) -> str:
        validate_key(key)
        return f"{self.root}/{key}" if self.root else key

    def _key(self, path: str) -> str:
        path = path.lstrip("/") if not self.root.startswith("/") else path
        return path[len(self.root) + 1 :] if self.root else path

    def _refresh(self, path: str) -> None:
        self.fs.invalidate_cache(path)  # s3fs and others cache listings and info: writers may be elsewhere

    # --- reads ------------------------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        path = self._path(key)
        self._refresh(path)
        try:
            return bytes(self.fs.cat_file(path))
        except FileNotFoundError as err:
            raise ObjectNotFound(f"{self.url}: {key}") from err
        except IsADirectoryError as err:
            raise ObjectNotFound(f"{self.url}: {key} is a directory") from err

    def _info(self, key: str) -> dict[str, Any]:
        path = self._path(key)
        self._refresh(path)
        try:
            info: dict[str, Any] = self.fs.info(path)
        except FileNotFoundError as err:
            raise ObjectNotFound(f"{self.url}: {key}") from err
        if info.get("type") == "directory":
            raise ObjectNotFound(f"{self.url}: {key} is a directory")
        return info

    def get_range(self, key: str, start: int, end: int | None = None) -> bytes:
        check_range_args(key, start, end)
        size = int(self._info(key)["size"])
        if start > size:
            raise InvalidRange(f"{self.url}: {key}: start {start} beyond size {size}")
        stop = size if end is None else min(end, size)
        if stop <= start:
            return b""
        try:
            return bytes(self.fs.cat_file(self._path(key), start=start, end=stop))
        except FileNotFoundError as err:
            raise ObjectNotFound(f"{self.url}: {key}") from err

    def head(self, key: str) -> ObjectInfo:
        info = self._info(key)
        etag = info.get("ETag") or info.get("etag")
        if etag is None:  # no server ETag: the content's MD5, as the memory and local stores give
            etag = hashlib.md5(self.get(key), usedforsecurity=False).hexdigest()
        return ObjectInfo(key=key, size=int(info["size"]), etag=strip_etag(str(etag)))

    def exists(self, key: str) -> bool:
        try:
            self._info(key)
        except ObjectNotFound:
            return False
        return True

    def list(self, prefix: str = "") -> Iterator[str]:
        validate_prefix(prefix)
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        top = "/".join(p for p in (self.root, base) if p)
        self._refresh(top)
        try:
            found = self.fs.find(top, withdirs=False) if top or not self.root else []
        except FileNotFoundError:
            found = []
        keys = sorted(k for k in (self._key(p) for p in found) if k.startswith(prefix) and k)
        yield from keys

    # --- writes -----------------------------------------------------------------------------------

    def put(self, key: str, data: bytes) -> str:
        path = self._path(key)
        try:
            out = self.fs.pipe_file(path, bytes(data))
        except OSError as err:
            raise StoreError(f"{self.url}: put {key}: {err}") from err
        self._refresh(path)
        return self._written_etag(out, data)

    def _refuse(self, what: str) -> ConditionalWriteUnsupported:
        return ConditionalWriteUnsupported(
            f"{self.url}: {type(self.fs).__name__} has no atomic conditional writes, so {what} (needed to "
            "publish) is refused; publish to deltarl's own backends (a local path, s3://, a relay) or through s3fs")

    def put_if_absent(self, key: str, data: bytes) -> str:
        path = self._path(key)
        if not self.conditional_writes:
            raise self._refuse("put_if_absent")
        try:
            out = self.fs.pipe_file(path, bytes(data), mode="create")
        except FileExistsError as err:
            raise ObjectExists(f"{self.url}: {key} exists") from err
        except OSError as err:
            if err.errno == errno.EINVAL and _is_412(err):
                raise ObjectExists(f"{self.url}: {key} exists") from err
            raise StoreError(f"{self.url}: put_if_absent {key}: {err}") from err
        self._refresh(path)
        return self._written_etag(out, data)

    def cas(self, key: str, data: bytes, expected_etag: str | None) -> str:
        path = self._path(key)
        if not self.conditional_writes:
            if expected_etag is not None and not self.exists(key):
                raise ObjectNotFound(f"{self.url}: {key}")
            raise self._refuse("cas")
        if expected_etag is None:
            try:
                return self.put_if_absent(key, data)
            except ObjectExists as err:
                raise PreconditionFailed(f"{self.url}: {key} exists") from err
        try:
            out = self.fs.pipe_file(path, bytes(data), IfMatch=f'"{expected_etag}"')
        except FileNotFoundError as err:
            raise ObjectNotFound(f"{self.url}: {key}") from err
        except OSError as err:
            if _is_412(err):
                if not self.exists(key):  # some servers answer a missing key's If-Match with 412
                    raise ObjectNotFound(f"{self.url}: {key}") from err
                raise PreconditionFailed(f"{self.url}: {key} is not at ETag {expected_etag}") from err
            cause = getattr(err.__cause__, "response", None)
            if isinstance(cause, dict) and cause.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                raise ObjectNotFound(f"{self.url}: {key}") from err
            raise StoreError(f"{self.url}: cas {key}: {err}") from err
        self._refresh(path)
        return self._written_etag(out, data)

    def _written_etag(self, out: Any, data: bytes) -> str:
        if isinstance(out, dict) and out.get("ETag"):
            return strip_etag(str(out["ETag"]))
        return hashlib.md5(data, usedforsecurity=False).hexdigest()

    def delete(self, key: str) -> None:
        path = self._path(key)
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(path)
        self._refresh(path)
