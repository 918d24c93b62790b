"""deltarl.storage: the object-store interface, its backends, and the run namespace on top of them."""

from typing import TYPE_CHECKING

# --- object stores (interface, backends, factory) ------------------------------------------------
from deltarl.storage.local import LocalStore
from deltarl.storage.memory import MemoryStore
from deltarl.storage.open import open_store
from deltarl.storage.store import ObjectInfo, ObjectStore

# isort: split
# --- the run namespace (layout, records, publishing, reading back) -------------------------------
from deltarl.storage.catchup import SquashRecord, read_squash, store_squash
from deltarl.storage.claim import WriterClaim, WriterLease
from deltarl.storage.gc import GcReport, gc
from deltarl.storage.inspect import RunSummary, VersionRow, inspect_run
from deltarl.storage.layout import RunLayout, is_immutable, validate_run_name
from deltarl.storage.manifest import (
    DeltaStatsRecord,
    HeadRecord,
    Manifest,
    ObjectRef,
    RunInfo,
    TensorEntry,
    canonical_json,
    version_id,
)
from deltarl.storage.publisher import Publisher, VersionInfo
from deltarl.storage.reader import RunReader
from deltarl.storage.replay import apply_versions, replay, squash

if TYPE_CHECKING:
    from deltarl.storage.retry import RetryPolicy
    from deltarl.storage.s3 import S3Store

__all__ = [
    "DeltaStatsRecord",
    "GcReport",
    "HeadRecord",
    "LocalStore",
    "Manifest",
    "MemoryStore",
    "ObjectInfo",
    "ObjectRef",
    "ObjectStore",
    "Publisher",
    "RetryPolicy",
    "RunInfo",
    "RunLayout",
    "RunReader",
    "RunSummary",
    "S3Store",
    "SquashRecord",
    "TensorEntry",
    "VersionInfo",
    "VersionRow",
    "WriterClaim",
    "WriterLease",
    "apply_versions",
    "canonical_json",
    "gc",
    "inspect_run",
    "is_immutable",
    "open_store",
    "read_squash",
    "replay",
    "squash",
    "store_squash",
    "validate_run_name",
    "version_id",
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
