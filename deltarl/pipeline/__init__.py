"""deltarl.pipeline: the lossless sparse delta format (encode, segments, staged transactional apply).

Importing this package imports neither torch nor numba; torch tensors are recognised when seen and
numba kernels are compiled on first use (set ``DELTARL_NO_NUMBA=1`` for the pure-numpy path).
"""

from deltarl.pipeline.encode import encode_delta, iter_encode_delta
from deltarl.pipeline.segment import ChunkInfo, DeltaStats, SegmentHeader, delta_stats, read_segment_header
from deltarl.pipeline.stage import StagedUpdate, Stager, apply_delta, stage_delta
from deltarl.pipeline.tensors import BF16, TensorSpec, check_compatible, state_digest, tensor_table

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
