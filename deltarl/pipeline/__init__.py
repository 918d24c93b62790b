"""deltarl.pipeline: the version pipeline.

Two halves, one data flow:

* the codec — the lossless sparse delta format (``encode_delta``, segments, staged
  transactional apply: ``stage_delta`` / ``StagedUpdate.commit`` / ``rollback``);
* the run namespace on top of an object store — layout, manifests and records, the writer
  claim, the :class:`Publisher` (and :class:`ShardedPublisher`, one per rank), the :class:`RunReader`, ``replay``, ``gc`` and ``inspect_run``.

Importing this package imports neither torch nor numba; torch tensors are recognised when seen and
numba kernels are compiled on first use (set ``DELTARL_NO_NUMBA=1`` for the pure-numpy path).
"""

from deltarl.pipeline.encode import encode_delta, iter_encode_delta
from deltarl.pipeline.segment import ChunkInfo, DeltaStats, SegmentHeader, delta_stats, read_segment_header
from deltarl.pipeline.stage import StagedUpdate, Stager, apply_delta, stage_delta
from deltarl.pipeline.tensors import BF16, TensorSpec, check_compatible, state_digest, tensor_table

# isort: split
from deltarl.pipeline.claim import WriterClaim, WriterLease
from deltarl.pipeline.gc import GcReport, gc
from deltarl.pipeline.inspect import RunSummary, VersionRow, inspect_run
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
from deltarl.pipeline.replay import apply_versions, replay, squash
from deltarl.pipeline.sharded import ShardedPublisher, ShardedVersionInfo

__all__ = [
    "BF16",
    "ChunkInfo",
    "DeltaStats",
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
    "SegmentHeader",
    "ShardedPublisher",
    "ShardedVersionInfo",
    "StagedUpdate",
    "Stager",
    "TensorEntry",
    "TensorSpec",
    "VersionInfo",
    "VersionRow",
    "WriterClaim",
    "WriterLease",
    "apply_delta",
    "apply_versions",
    "canonical_json",
    "check_compatible",
    "delta_stats",
    "encode_delta",
    "gc",
    "inspect_run",
    "is_immutable",
    "iter_encode_delta",
    "read_segment_header",
    "replay",
    "squash",
    "stage_delta",
    "state_digest",
    "tensor_table",
    "validate_run_name",
    "version_id",
]
