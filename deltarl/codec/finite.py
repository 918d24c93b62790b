"""The finite-values check every publish runs: one NaN or Inf in a published state poisons every actor.

A float is NaN or Inf exactly when its exponent bits are all ones, so the check reads each floating
tensor as raw integers in 1M-element chunks: ``max(bits & exponent_mask)`` per chunk (numpy SIMD,
two chunk-sized buffers, no numba import: a keyframe-only publish stays as lean as before). Only a
tensor that has such an element pays for an exact count. A dtype without a known layout (or a
device tensor) falls back to one float32 sum (NaN or Inf anywhere makes it non-finite).
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from deltarl.codec.kernels import worker_threads
from deltarl.errors import NonFiniteTensor

# raw-bits dtype and exponent mask of each float dtype (by itemsize and numpy kind)
_MASKS = {"bfloat16": (np.uint16, 0x7F80), "float16": (np.uint16, 0x7C00),
          "float32": (np.uint32, 0x7F800000), "float64": (np.uint64, 0x7FF0000000000000),
          "float8_e4m3fn": (np.uint8, 0x7F), "float8_e5m2": (np.uint8, 0x7C)}  # e4m3fn: NaN only, S.1111.111


_CHUNK = 1 << 20


def _count_bits(bits: np.ndarray, mask: int) -> int:
    """Elements of ``bits`` (the raw integer view of a float array) whose exponent bits are all ones."""
    flat = bits.reshape(-1)
    m = flat.dtype.type(mask)
    buf = np.empty(min(_CHUNK, flat.size), dtype=flat.dtype)
    bad = 0
    for lo in range(0, flat.size, _CHUNK):
        chunk = flat[lo : lo + _CHUNK]
        out = buf[: chunk.size]
        np.bitwise_and(chunk, m, out=out)
        if out.max() == m:
            bad += int(np.count_nonzero(out == m))
    return bad


def nonfinite_bits(bits: np.ndarray, dtype: str) -> int:
    """Elements of ``bits`` (raw integer bits of ``dtype`` values) that are NaN or Inf; 0 for a
    dtype that is not floating. The encoder checks a chunk's changed values with it."""
    spec = _MASKS.get(dtype)
    if spec is None or bits.size == 0:
        return 0
    return _count_bits(bits.view(spec[0]), spec[1])


def exponent_mask(dtype: str) -> int:
    """The bits that are all ones in a NaN or Inf of ``dtype`` (e4m3fn: its NaN), 0 for a dtype that
    is not floating: a batched encoder counts :func:`nonfinite_bits` with it."""
    spec = _MASKS.get(dtype)
    return 0 if spec is None else spec[1]


def _torch_nonfinite(t: Any) -> int:
    import torch

    if not t.is_floating_point() or t.numel() == 0:
        return 0
    spec = _MASKS.get(str(t.dtype).removeprefix("torch."))
    if spec is not None and t.device.type == "cpu" and t.is_contiguous():
        int_dtype = {np.uint8: torch.int8, np.uint16: torch.int16, np.uint32: torch.int32, np.uint64: torch.int64}[spec[0]]
        return _count_bits(t.view(int_dtype).numpy().view(spec[0]), spec[1])
    if bool(torch.isfinite(t.sum(dtype=torch.float32))):
        return 0
    return int((~torch.isfinite(t)).sum())


def _numpy_nonfinite(a: np.ndarray) -> int:
    if a.dtype.kind != "f" or a.size == 0:
        return 0
    spec = _MASKS.get(a.dtype.name)
    if spec is not None and a.flags.c_contiguous:
        return _count_bits(a.view(spec[0]), spec[1])
    with np.errstate(over="ignore", invalid="ignore"):
        if np.isfinite(a.sum(dtype=np.float64)):
            return 0
    return int(a.size - np.count_nonzero(np.isfinite(a)))


def _nonfinite(value: Any) -> int:
    if isinstance(value, np.ndarray):
        return _numpy_nonfinite(value)
    if hasattr(value, "is_floating_point") and hasattr(value, "numel"):
        return _torch_nonfinite(value)
    return 0  # not a tensor: not checked


def check_finite(state_dict: Mapping[str, Any], *, threads: int | None = None) -> None:
    """Raise :class:`~deltarl.errors.NonFiniteTensor` naming the first floating tensor (in the
    mapping's order) that holds NaN or Inf (torch tensors and numpy arrays; other values are not
    checked). Tensors are checked on ``threads`` threads (default: :func:`worker_threads`; numpy releases the
    GIL), so the pass scales with cores like the encoder it precedes."""
    items = list(state_dict.items())
    workers = max(1, min(threads or worker_threads(), len(items)))
    if workers == 1:
        counts = [_nonfinite(value) for _, value in items]
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="deltarl-finite") as pool:
            counts = list(pool.map(lambda item: _nonfinite(item[1]), items))
    for (name, value), bad in zip(items, counts, strict=True):
        if bad:
            raise NonFiniteTensor(f"tensor {name!r} holds {bad} NaN/Inf values of {_numel(value)}; "
                                  "refusing to publish it (pass allow_nonfinite=True to publish anyway)")


def is_finite(state_dict: Mapping[str, Any], *, threads: int | None = None) -> bool:
    """Whether no floating tensor of ``state_dict`` holds NaN or Inf (what :func:`check_finite` checks)."""
    try:
        check_finite(state_dict, threads=threads)
    except NonFiniteTensor:
        return False
    return True


def check_before_encode(state_dict: Mapping[str, Any], *, allow_nonfinite: bool, base_finite: bool) -> bool:
    """The finite check of one version, before its delta is encoded; returns whether the encoder
    must check the changed values (``check_finite=`` of the encode functions).

    A delta from a base known to hold no NaN/Inf is finite iff its changed values are, so then only
    those are checked (inside the encoder: a ~1% gather, not a pass over the state); otherwise the
    whole state is checked here. ``allow_nonfinite`` checks nothing."""
    if allow_nonfinite:
        return False
    if base_finite:
        return True
    check_finite(state_dict)
    return False


def _numel(value: Any) -> int:
    return int(value.size) if isinstance(value, np.ndarray) else int(value.numel())
