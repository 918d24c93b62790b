"""deltarl.pipeline: the version pipeline on an object store.

The run namespace (layout, manifests and records), the writer claim, the :class:`Publisher` (and
:class:`ShardedPublisher`, one per rank), the :class:`RunReader`, ``replay``, ``gc`` and
``inspect_run``. The delta format itself is :mod:`deltarl.codec`.

Importing this package imports neither torch nor numba.
"""

from deltarl.pipeline.catch_up import HeldState, catch_up, check_up_to_head, walk_down
from deltarl.pipeline.claim import WriterClaim, WriterLease
from deltarl.pipeline.gc import PENDING_GRACE_S, GcReport, gc
from deltarl.pipeline.inspection import RunSummary, VersionRow, human_bytes, inspect_run, spans
from deltarl.pipeline.keyframe import empty_state, part_views
from deltarl.pipeline.layout import (
    VERSION_DIGITS,
    RunLayout,
    is_immutable,
    key_epoch,
    manifest_key_for,
    validate_run_name,
)
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
from deltarl.pipeline.pieces import (
    MAX_PIECE_SIZE,
    MIN_PIECE_SIZE,
    PieceVerifier,
    hash_piece,
    pieces_of_blocks,
)
from deltarl.pipeline.publish_config import PublishConfig
from deltarl.pipeline.publisher import Publisher, VersionInfo
from deltarl.pipeline.reader import RunReader
from deltarl.pipeline.region_reads import SegmentPart, read_segment_parts
from deltarl.pipeline.replay import replay, roll_forward, squash
from deltarl.pipeline.shard_digest import ShardHashes, TensorShardHashes, combine_digest
from deltarl.pipeline.sharded import ShardedPublisher
from deltarl.pipeline.state_file import write_state_file

__all__ = [
    "MAX_PIECE_SIZE",
    "MIN_PIECE_SIZE",
    "PENDING_GRACE_S",
    "VERSION_DIGITS",
    "DeltaStatsRecord",
    "GcReport",
    "HeadRecord",
    "HeldState",
    "Manifest",
    "ObjectRef",
    "PieceVerifier",
    "PublishConfig",
    "Publisher",
    "RunInfo",
    "RunLayout",
    "RunReader",
    "RunSummary",
    "SegmentPart",
    "ShardHashes",
    "ShardedPublisher",
    "TensorEntry",
    "TensorShardHashes",
    "VersionInfo",
    "VersionRow",
    "WriterClaim",
    "WriterLease",
    "canonical_json",
    "catch_up",
    "check_up_to_head",
    "combine_digest",
    "empty_state",
    "gc",
    "hash_piece",
    "human_bytes",
    "inspect_run",
    "is_immutable",
    "key_epoch",
    "manifest_key_for",
    "part_views",
    "pieces_of_blocks",
    "read_segment_parts",
    "replay",
    "roll_forward",
    "spans",
    "squash",
    "validate_run_name",
    "version_id",
    "walk_down",
    "write_state_file",
]
