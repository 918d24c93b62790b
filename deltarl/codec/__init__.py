"""deltarl.codec: the lossless sparse delta format and its kernels.

* :func:`encode_delta` / :func:`iter_encode_delta` - the delta between two states, as segments;
* segments (:func:`read_segment_header`, :class:`SegmentHeader`, :func:`delta_stats`);
* the apply transaction: :func:`stage_delta` decodes segments against the base into a
  :class:`StagedUpdate` (nothing written), whose ``commit`` / ``rollback`` write in place;
  :func:`apply_delta` does both;
* bit views of tensors (:class:`BF16`, :class:`TensorSpec`, :func:`tensor_table`,
  :func:`check_compatible`) and the whole-state digest (:func:`state_digest`).

The codec knows nothing of stores or runs (that is :mod:`deltarl.pipeline`). Importing it imports
neither torch nor numba; torch tensors are recognised when seen and numba kernels are compiled on
first use (set ``DELTARL_NO_NUMBA=1`` for the pure-numpy path).
"""

from deltarl.codec.apply import StagedUpdate, Stager, apply_delta, stage_delta
from deltarl.codec.encode import encode_delta, iter_encode_delta
from deltarl.codec.segment import ChunkInfo, DeltaStats, SegmentHeader, delta_stats, read_segment_header
from deltarl.codec.tensors import BF16, TensorSpec, check_compatible, state_digest, tensor_table

__all__ = [
    "BF16",
    "ChunkInfo",
    "DeltaStats",
    "SegmentHeader",
    "StagedUpdate",
    "Stager",
    "TensorSpec",
    "apply_delta",
    "check_compatible",
    "delta_stats",
    "encode_delta",
    "iter_encode_delta",
    "read_segment_header",
    "stage_delta",
    "state_digest",
    "tensor_table",
]
