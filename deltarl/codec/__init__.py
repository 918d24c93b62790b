"""deltarl.codec: the lossless sparse delta format and its kernels.

* :func:`encode_delta` / :func:`iter_encode_delta` - the delta between two states, as segments;
* segments (:func:`read_segment_header`, :class:`SegmentHeader`, :func:`delta_stats`);
* the apply transaction: :func:`stage_delta` decodes segments against the base into a
  :class:`StagedUpdate` (nothing written), whose ``commit`` / ``rollback`` write in place;
  :func:`apply_delta` does both;
* parts of tensors a tensor- or expert-parallel rank holds (:class:`Region`, :func:`plan_chunks`,
  ``stage_delta(..., regions=...)``; the shard grid :class:`Grid`);
* bit views of tensors (:class:`BF16`, :class:`TensorSpec`, :func:`tensor_table`,
  :func:`check_compatible`) and the whole-state digest (:func:`state_digest`).

The codec knows nothing of stores or runs (that is :mod:`deltarl.pipeline`). Importing it imports
neither torch nor numba; torch tensors are recognised when seen and numba kernels are compiled on
first use (set ``DELTARL_NO_NUMBA=1`` for the pure-numpy path).
"""

from deltarl.codec.apply import StagedUpdate
from deltarl.codec.encode import SEGMENT_CHANGES, encode_delta, iter_encode_delta, iter_encode_rows
from deltarl.codec.finite import check_before_encode, check_finite, is_finite
from deltarl.codec.grid import Grid
from deltarl.codec.hashing import (
    BLOCK,
    HASH_BYTES,
    block_hash,
    content_id,
    leaves,
    object_root,
    piece_hash,
    state_root,
)
from deltarl.codec.heap import trim
from deltarl.codec.jit_warmup import warm_codec_quietly
from deltarl.codec.kernels import worker_threads
from deltarl.codec.regions import ChunkRef, Region, byte_ranges, plan_chunks, span_of
from deltarl.codec.segment import ChunkInfo, DeltaStats, SegmentHeader, delta_stats, read_segment_header
from deltarl.codec.stager import Stager, apply_delta, stage_delta
from deltarl.codec.tensors import (
    BF16,
    DIGEST_ALGO,
    DIGEST_ALGOS,
    DTYPES,
    TensorSpec,
    check_compatible,
    dtype_of,
    flat_bits,
    is_cuda,
    state_digest,
    stream_offsets,
    table_bytes,
    tensor_table,
    uint_dtype,
)

__all__ = [
    "BF16",
    "BLOCK",
    "DIGEST_ALGO",
    "DIGEST_ALGOS",
    "DTYPES",
    "HASH_BYTES",
    "SEGMENT_CHANGES",
    "ChunkInfo",
    "ChunkRef",
    "DeltaStats",
    "Grid",
    "Region",
    "SegmentHeader",
    "StagedUpdate",
    "Stager",
    "TensorSpec",
    "apply_delta",
    "block_hash",
    "byte_ranges",
    "check_before_encode",
    "check_compatible",
    "check_finite",
    "content_id",
    "delta_stats",
    "dtype_of",
    "encode_delta",
    "flat_bits",
    "is_cuda",
    "is_finite",
    "iter_encode_delta",
    "iter_encode_rows",
    "leaves",
    "object_root",
    "piece_hash",
    "plan_chunks",
    "read_segment_header",
    "span_of",
    "stage_delta",
    "state_digest",
    "state_root",
    "stream_offsets",
    "table_bytes",
    "tensor_table",
    "trim",
    "uint_dtype",
    "warm_codec_quietly",
    "worker_threads",
]
