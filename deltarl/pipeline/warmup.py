"""Warm the codec before the first real delta: numba loads each compiled signature from its cache
on first call (~0.3 s in all), so a publisher or a bootstrap pays it on a worker thread while it
waits for other things (the trainer's step, the keyframe) instead of inside its first version."""

from __future__ import annotations

import numpy as np

from deltarl.pipeline import kernels

#: Elements of the warm-up tensors, cut into 16 chunks (so the paired decoder runs too).
_ELEMENTS = 1 << 18
_SEGMENT_BYTES = 1 << 16
_BASE = "0" * 64


def warm_codec() -> None:
    """Encode, check and stage a tiny delta of each raw width (16 and 32 bits); nothing is kept."""
    from deltarl.pipeline.encode import iter_encode_delta
    from deltarl.pipeline.stage import stage_delta

    if kernels.jit() is None:
        return  # the numpy path has nothing to load
    rng = np.random.default_rng(0)
    for dtype in (np.float16, np.float32):
        old = {"w": rng.standard_normal(_ELEMENTS).astype(dtype)}
        new = {"w": old["w"].copy()}
        new["w"][::97] = np.nextafter(new["w"][::97], np.inf)
        segments = list(iter_encode_delta(old, new, base=_BASE, segment_bytes=_SEGMENT_BYTES, check_finite=True))
        stage_delta(old, segments, base=_BASE)


__all__ = ["warm_codec"]
