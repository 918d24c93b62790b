"""deltarl.storage: the object-store interface, its backends, and the run namespace on top of them."""

from typing import TYPE_CHECKING

# --- object stores (interface, backends, factory) ------------------------------------------------
from deltarl.storage.local import LocalStore
from deltarl.storage.memory import MemoryStore
from deltarl.storage.open import open_store
from deltarl.storage.store import ObjectInfo, ObjectStore

if TYPE_CHECKING:
    from deltarl.storage.retry import RetryPolicy
    from deltarl.storage.s3 import S3Store

__all__ = [
    "LocalStore",
    "MemoryStore",
    "ObjectInfo",
    "ObjectStore",
    "RetryPolicy",
    "S3Store",
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
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
