"""deltarl.pipeline: the version pipeline on an object store.

The run namespace (layout, manifests and records), the writer claim, the :class:`Publisher` (and
:class:`ShardedPublisher`, one per rank), the :class:`RunReader`, ``replay``, ``gc`` and
``inspect_run``. The delta format itself is :mod:`deltarl.codec`.

Importing this package imports neither torch nor numba.
"""

from deltarl.pipeline.claim import WriterClaim, WriterLease
from deltarl.pipeline.gc import GcReport, gc
from deltarl.pipeline.inspection import RunSummary, VersionRow, inspect_run
from deltarl.pipeline.layout import RunLayout, is_immutable, validate_run_name
from deltarl.pipeline.manifest import (
    DeltaStatsRecord,
    HeadRecord,
    Manifest,
    ObjectRef,
    RunInfo,
    TensorEntry,
    canonical_json,
    version_id,
)
from deltarl.pipeline.publish_config import PublishConfig
from deltarl.pipeline.publisher import Publisher, VersionInfo
from deltarl.pipeline.reader import RunReader
from deltarl.pipeline.replay import replay, roll_forward, squash
from deltarl.pipeline.sharded import ShardedPublisher

__all__ = [
    "DeltaStatsRecord",
    "GcReport",
    "HeadRecord",
    "Manifest",
    "ObjectRef",
    "PublishConfig",
    "Publisher",
    "RunInfo",
    "RunLayout",
    "RunReader",
    "RunSummary",
    "ShardedPublisher",
    "TensorEntry",
    "VersionInfo",
    "VersionRow",
    "WriterClaim",
    "WriterLease",
    "canonical_json",
    "gc",
    "inspect_run",
    "is_immutable",
    "replay",
    "roll_forward",
    "squash",
    "validate_run_name",
    "version_id",
]
