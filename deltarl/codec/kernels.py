"""Hot per-element loops, in numba when available and a pure-numpy fallback that gives equal results.

Only the loops that touch every element of a chunk live here (change detection, per-class ranks,
the numpy decoder's per-class select, commit's gather/scatter); the encoder's per-*changed*-element
work is vectorised numpy shared by both paths, so the bytes produced never depend on which path ran.
The numba ctx decoder is a module of its own (``_numba_ctx``, see :func:`ctx_jit`). numba is
imported on first use, never at ``import deltarl.codec``; ``DELTARL_NO_NUMBA=1`` (read at every
call) forces numpy.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import numpy as np

from deltarl import defaults
from deltarl.errors import FormatError

log = logging.getLogger(__name__)


def numba_enabled() -> bool:
    """True unless ``DELTARL_NO_NUMBA`` is set to a non-empty value other than ``0``."""
    return os.environ.get(defaults.NO_NUMBA_ENV, "") in ("", "0")


def worker_threads() -> int:
    """Threads for chunk-parallel encode, decode and commit: ``DELTARL_THREADS`` or the CPU count
    (the CPUs this process may run on, where the OS says)."""
    raw = os.environ.get(defaults.THREADS_ENV, "")
    if raw:
        try:
            return max(1, int(raw))
        except ValueError:
            log.warning("ignoring DELTARL_THREADS=%r (not an integer)", raw)
    affinity = getattr(os, "sched_getaffinity", None)
    return max(1, len(affinity(0)) if affinity is not None else (os.cpu_count() or 1))


@functools.lru_cache(maxsize=1)
def _compiled() -> Any:
    try:
        from deltarl.codec import _numba_kernels
    except ImportError as err:  # numba missing or broken: the numpy path is always correct
        log.warning("numba unavailable, using the numpy codec path: %s", err)
        return None
    return _numba_kernels


def jit() -> Any:
    """The compiled kernels module, or None when numba is disabled or missing."""
    return _compiled() if numba_enabled() else None


@functools.lru_cache(maxsize=1)
def _compiled_ctx() -> Any:
    if _compiled() is None:
        return None
    from deltarl.codec import _numba_ctx

    return _numba_ctx


def ctx_jit() -> Any:
    """The fused numba ctx decoder module, or None when numba is disabled or missing."""
    return _compiled_ctx() if numba_enabled() else None


def changed_positions(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Sorted int64 indices where the bit patterns differ."""
    k = jit()
    if k is None:
        return np.flatnonzero(old != new)
    return k.changed_positions(old, new)


def classes(bits: np.ndarray, shift: int, mask: int) -> np.ndarray:
    """Context class of each element: its exponent field, as int64."""
    return ((bits >> bits.dtype.type(shift)) & bits.dtype.type(mask)).astype(np.int64)


def class_ranks(old: np.ndarray, new: np.ndarray, shift: int, mask: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Changed positions (sorted), their class, and their rank among same-class elements of the chunk."""
    k = jit()
    if k is not None:
        pos, cls, rank = k.class_ranks(old, new, shift, mask)
        return pos, cls, rank
    pos = np.flatnonzero(old != new)
    c_all = ((old >> old.dtype.type(shift)) & old.dtype.type(mask)).astype(
        np.uint8 if mask < 256 else np.uint16
    )
    order = np.argsort(c_all, kind="stable")
    starts = np.concatenate(([0], np.cumsum(np.bincount(c_all, minlength=mask + 1))))
    inv = np.empty(old.size, dtype=np.int64)
    inv[order] = np.arange(old.size, dtype=np.int64)
    cls = c_all[pos].astype(np.int64)
    return pos, cls, inv[pos] - starts[cls]


def class_select(old: np.ndarray, shift: int, mask: int, targets: np.ndarray, tptr: np.ndarray) -> np.ndarray:
    """Positions of the requested same-class ranks, or -1 where a rank exceeds its class size (numpy).

    ``targets[tptr[c]:tptr[c+1]]`` are strictly increasing ranks within class ``c``; the result is
    aligned with ``targets`` (class-major order).
    """
    c_all = ((old >> old.dtype.type(shift)) & old.dtype.type(mask)).astype(
        np.uint8 if mask < 256 else np.uint16
    )
    order = np.argsort(c_all, kind="stable")
    counts = np.bincount(c_all, minlength=mask + 1)
    starts = np.concatenate(([0], np.cumsum(counts)))
    tcls = np.repeat(np.arange(mask + 1), np.diff(tptr))
    ok = targets < counts[tcls]
    out = np.full(targets.size, -1, dtype=np.int64)
    out[ok] = order[starts[tcls[ok]] + targets[ok]]
    return out


def class_select_sorted(
    old: np.ndarray, shift: int, mask: int, targets: np.ndarray, tptr: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`class_select`, returned sorted by position: (positions, index into ``targets``).

    Raises FormatError when a rank exceeds the number of elements of its class. (numpy only: the
    numba ctx decoder in _numba_ctx scans without materialising ranks.)
    """
    cm = class_select(old, shift, mask, targets, tptr)
    if cm.size and int(cm.min()) < 0:
        raise FormatError("ctx rank beyond the number of same-class elements")
    order = np.argsort(cm, kind="stable")
    return cm[order], order


def gather(flat: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """``flat[pos]`` as a new array (positions already validated to be in range)."""
    k = jit()
    return flat[pos] if k is None else k.gather(flat, pos)


def scatter(flat: np.ndarray, pos: np.ndarray, vals: np.ndarray) -> None:
    """``flat[pos] = vals`` (positions already validated to be in range)."""
    k = jit()
    if k is None:
        flat[pos] = vals
    else:
        k.scatter(flat, pos, vals)


def all_old_or_new(flat: np.ndarray, pos: np.ndarray, old: np.ndarray, new: np.ndarray) -> bool:
    """True when every ``flat[pos[j]]`` equals ``old[j]`` or ``new[j]``."""
    k = jit()
    if k is None:
        cur = flat[pos]
        return bool(((cur == old) | (cur == new)).all())
    return bool(k.first_stale(flat, pos, old, new) < 0)


def write_strict(flat: np.ndarray, pos: np.ndarray, other: np.ndarray, vals: np.ndarray) -> int:
    """``flat[pos] = vals`` if every ``flat[pos[j]]`` holds ``other[j]``: -1. Else the index of the
    first position that does not, with ``flat`` as it was (what was written is undone with ``other``,
    the bits it replaced: nothing needs saving while writing)."""
    k = jit()
    if k is not None:
        return int(k.write_strict(flat, pos, other, vals))
    bad = np.flatnonzero(flat[pos] != other)
    if bad.size:
        return int(bad[0])
    flat[pos] = vals
    return -1
