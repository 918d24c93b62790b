"""deltarl.storage: object stores only — the interface, its backends, and ``open_store``.

Every backend implements :class:`ObjectStore` (``get``, ``get_range``, ``put``,
``put_if_absent``, ``exists``, ``list``, ``delete``, ``cas``); ``open_store`` turns a URL
(a path, ``file://``, ``memory://``, ``s3://``, ``http(s)://``) into one. The run namespace on
top of a store (manifests, publishing, replay) is :mod:`deltarl.pipeline`.
"""

from typing import TYPE_CHECKING

from deltarl.storage.local import LocalStore
from deltarl.storage.memory import MemoryStore
from deltarl.storage.open import open_store
from deltarl.storage.store import ObjectInfo, ObjectStore, PendingWrite

if TYPE_CHECKING:
    from deltarl.storage.aio import AsyncSource, make_async_source
    from deltarl.storage.retry import RetryPolicy
    from deltarl.storage.s3 import S3Store

__all__ = [
    "AsyncSource",
    "LocalStore",
    "MemoryStore",
    "ObjectInfo",
    "ObjectStore",
    "PendingWrite",
    "RetryPolicy",
    "S3Store",
    "make_async_source",
    "open_store",
]


def __getattr__(name: str) -> object:
    # S3Store and RetryPolicy import boto3 (~0.3 s): load them on first use only.
    if name == "S3Store":
        from deltarl.storage.s3 import S3Store

        return S3Store
    if name == "RetryPolicy":
        from deltarl.storage.retry import RetryPolicy

        return RetryPolicy
    if name in ("AsyncSource", "make_async_source"):  # aiohttp: only where async reads are used
        from deltarl.storage import aio

        return getattr(aio, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
