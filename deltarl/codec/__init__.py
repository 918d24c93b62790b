"""deltarl.codec: the lossless sparse delta format and its kernels.

* :func:`encode_delta` / :func:`iter_encode_delta` - the delta between two states, as segments;
* :func:`read_segment_header` / :func:`delta_stats` - what a segment holds;
* the apply transaction: :func:`stage_delta` decodes segments against the base into a
  ``StagedUpdate`` (nothing written), whose ``commit`` / ``rollback`` write in place;
  :func:`apply_delta` does both;
* :class:`BF16` (bfloat16 bits held as uint16) and the whole-state digest (:func:`state_digest`).

Inside: ``chunk`` (what a chunk codec is), one module per codec (``aurora``, ``rice``, ``dense``,
``ctx``, ``sparse``) and their table (``registry``), ``segment``, ``encode``, ``apply`` /
``device_apply``, ``tensors``, ``hashing``, ``bitio`` and ``kernels`` (numba ones in ``_numba_*``).

The codec knows nothing of stores or runs (that is :mod:`deltarl.pipeline`). Importing it imports
neither torch nor numba; torch tensors are recognised when seen and numba kernels are compiled on
first use (set ``DELTARL_NO_NUMBA=1`` for the pure-numpy path).
"""

from __future__ import annotations

from deltarl.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "encode": ("encode_delta", "iter_encode_delta"),
    "stager": ("stage_delta", "apply_delta"),
    "segment": ("read_segment_header", "delta_stats"),
    "tensors": ("state_digest", "BF16"),
})
