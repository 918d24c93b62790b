"""deltarl.storage: object stores only — the interface, its backends, and ``open_store``.

Every backend implements :class:`ObjectStore` (``get``, ``get_range``, ``put``,
``put_if_absent``, ``exists``, ``list``, ``delete``, ``cas``); ``open_store`` turns a URL
(a path, ``file://``, ``memory://``, ``s3://``, ``http(s)://``) into one. The run namespace on
top of a store (manifests, publishing, replay) is :mod:`deltarl.pipeline`.
"""

from typing import TYPE_CHECKING

from deltarl.storage.keys import etag_of, strip_etag, validate_key, validate_prefix
from deltarl.storage.local import LocalStore
from deltarl.storage.memory import MemoryStore
from deltarl.storage.open import open_store
from deltarl.storage.pagecache import FLUSH_WINDOW_BYTES, flush_and_drop
from deltarl.storage.store import ObjectInfo, ObjectStore, PendingWrite

if TYPE_CHECKING:
    from deltarl.storage.aio import AsyncSource, make_async_source
    from deltarl.storage.http_client import RelayClient
    from deltarl.storage.retry import POLL_BACKOFF, RetryPolicy
    from deltarl.storage.s3 import S3Store

__all__ = [
    "FLUSH_WINDOW_BYTES",
    "POLL_BACKOFF",
    "AsyncSource",
    "LocalStore",
    "MemoryStore",
    "ObjectInfo",
    "ObjectStore",
    "PendingWrite",
    "RelayClient",
    "RetryPolicy",
    "S3Store",
    "etag_of",
    "flush_and_drop",
    "make_async_source",
    "open_store",
    "strip_etag",
    "validate_key",
    "validate_prefix",
]


def __getattr__(name: str) -> object:
    # S3Store and the retry policy import boto3 (~0.3 s): load them on first use only.
    if name == "S3Store":
        from deltarl.storage.s3 import S3Store

        return S3Store
    if name in ("RetryPolicy", "POLL_BACKOFF"):
        from deltarl.storage import retry

        return getattr(retry, name)
    if name == "RelayClient":  # aiohttp: only where a relay is read
        from deltarl.storage.http_client import RelayClient

        return RelayClient
    if name in ("AsyncSource", "make_async_source"):  # aiohttp: only where async reads are used
        from deltarl.storage import aio

        return getattr(aio, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
