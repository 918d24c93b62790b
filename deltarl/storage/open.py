"""``open_store(url)``: the one factory that turns a store URL into an :class:`ObjectStore`.

Accepted URLs:

* a plain path (``runs/``, ``/data/runs``, ``~/runs``) or ``file:///abs/path`` → :class:`LocalStore`;
* ``memory://`` or ``memory://name`` → a **fresh, empty** :class:`MemoryStore` on every call (the
  name is only a label; there is no process-wide registry, so pass the store object around to
  share it);
* ``s3://bucket`` or ``s3://bucket/prefix`` → :class:`S3Store`; the endpoint comes from the
  ``endpoint_url=`` option, else ``DELTARL_S3_ENDPOINT``, ``AWS_ENDPOINT_URL_S3`` or
  ``AWS_ENDPOINT_URL``; credentials and region from the usual AWS settings or options;
* ``http://host:port`` or ``https://…`` → :class:`HTTPStore`, a deltarl relay (or anything speaking
  its HTTP API, e.g. an nginx cache in front of one) used as a store;
* any other scheme that fsspec knows (``gcs://``, ``gs://``, ``az://``, ``abfs://``, ``hf://``, …)
  → :class:`~deltarl.storage.fsspec_store.FsspecStore`, readable everywhere, publishable only where
  the filesystem has atomic conditional writes;
* ``fsspec+<scheme>://…`` forces fsspec for a scheme deltarl handles itself (``fsspec+memory://``,
  ``fsspec+file:///dir``, ``fsspec+s3://bucket/prefix`` for s3fs).

Precedence: deltarl's own backends win for plain paths, ``file://``, ``memory://``, ``s3://`` and
``http(s)://`` (they differ from fsspec's: a fresh ``memory://`` per call, atomic local writes with
``O_EXCL``, S3 conditional writes through boto3); fsspec takes every other scheme it knows.

Extra keyword options go to the backend's constructor; an unknown option or a malformed URL
raises :class:`~deltarl.errors.ConfigError`. Roles that only read a store (inspect, replay, gc, a
relay's upstream, an actor's origin) open it with ``must_exist=True``, so a mistyped local path is
refused instead of becoming a new, empty store. Writers (the trainer, the coordinator, which writes
a run's results and may start first) create a missing local folder; no role creates a bucket.
"""

from __future__ import annotations

import inspect
import os
from typing import Any
from urllib.parse import unquote, urlsplit

from deltarl.errors import ConfigError
from deltarl.storage.store import ObjectStore


def open_store(url: str | os.PathLike[str], *, must_exist: bool = False, **options: Any) -> ObjectStore:
    """Open the store that ``url`` names (see the module docstring for the forms).

    Args:
        url: a path, ``file:///abs``, ``memory://[name]``, ``s3://bucket[/prefix]`` or a relay's
            ``http(s)://host:port``.
        must_exist: refuse a local folder that does not exist (``StoreNotFound``) instead of
            creating it; nothing is created. Other backends never create their bucket or server.
        **options: keyword options of the backend's constructor (e.g. ``endpoint_url=`` for S3,
            ``token=`` for a relay).

    Returns:
        The :class:`ObjectStore`; close it when done (``store.close()``).

    Raises:
        ConfigError: a malformed URL, an unknown scheme or an option the backend does not take.
        StoreNotFound: ``must_exist`` and the local folder is missing.

    Example:
        >>> store = open_store("memory://demo")
        >>> store.put("a/b", b"bytes") and store.get("a/b")
        b'bytes'
    """
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if not isinstance(url, str) or not url:
        raise ConfigError(f"store URL must be a non-empty string, got {url!r}")
    if url.lower().startswith("fsspec+"):
        return _build("fsspec", (url[len("fsspec+"):],), options)
    local = {"create": False} if must_exist else {}
    if "://" not in url:
        return _build("local", (url,), {**local, **options})
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if parts.query or parts.fragment:
        raise ConfigError(f"store URL must not carry a query or fragment: {url!r}")
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ConfigError(f"file:// URL must be file:///absolute/path, got {url!r}")
        if not parts.path:
            raise ConfigError(f"file:// URL has no path: {url!r}")
        return _build("local", (unquote(parts.path),), {**local, **options})
    if scheme == "memory":
        name = (parts.netloc + parts.path).strip("/") or None
        return _build("memory", (name,), options)
    if scheme == "s3":
        bucket = parts.netloc
        if not bucket:
            raise ConfigError(f"s3:// URL has no bucket: {url!r}")
        return _build("s3", (bucket, unquote(parts.path).strip("/")), options)
    if scheme in ("http", "https"):
        if not parts.netloc:
            raise ConfigError(f"{scheme}:// URL has no host: {url!r}")
        return _build("http", (url,), options)
    if _fsspec_knows(scheme):
        return _build("fsspec", (url,), options)
    raise ConfigError(
        f"unsupported store URL scheme {scheme!r} in {url!r} (path, file://, memory://, s3://, http(s)://, "
        "or a scheme fsspec knows: gcs://, az://, hf://, …)"
    )


def _fsspec_knows(scheme: str) -> bool:
    try:
        from fsspec.registry import known_implementations, registry
    except ImportError:
        return False
    return scheme in known_implementations or scheme in registry


def _build(kind: str, args: tuple[Any, ...], options: dict[str, Any]) -> ObjectStore:
    cls: type[ObjectStore]
    if kind == "local":
        from deltarl.storage.local import LocalStore

        cls = LocalStore
    elif kind == "memory":
        from deltarl.storage.memory import MemoryStore

        cls = MemoryStore
    elif kind == "http":
        from deltarl.storage.http import HTTPStore

        cls = HTTPStore
    elif kind == "fsspec":
        from deltarl.storage.fsspec_store import FsspecStore

        cls = FsspecStore
    else:
        from deltarl.storage.s3 import S3Store

        cls = S3Store
    try:
        inspect.signature(cls).bind(*args, **options)
    except TypeError as err:
        raise ConfigError(f"bad option for a {kind} store: {err}") from err
    return cls(*args, **options)
