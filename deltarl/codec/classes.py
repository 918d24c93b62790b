"""The base's exponent classes: the context that the ``ctx`` codec codes changes in.

The receiver holds the base, so both sides know every element's *class* (its exponent field). A
codec that ``needs_classes`` gets, from change detection, each change's class and its rank among
the chunk's same-class elements, with the Rice parameters per class: the :class:`ClassCode`,
computed in one pass over the chunk (numba, or numpy with equal results).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from deltarl.codec import bitio, kernels

# Exponent field of each bit width's float formats: 16 bit -> set by caller (bf16 vs fp16).
CLASS_FIELDS = {"bfloat16": (7, 8), "float16": (10, 5), "float32": (23, 8), "float8_e4m3fn": (3, 4), "float8_e5m2": (2, 5)}
# A grid cell's chunk is small (often a few hundred changes): classes of two exponents each halve
# its class table for the same rank-gap code (-10..-25% bytes per cell at 1% changed).
CELL_CLASS_FIELDS = {"bfloat16": (8, 7), "float16": (11, 4), "float32": (24, 7), "float8_e4m3fn": (4, 3),
                     "float8_e5m2": (3, 4)}


@dataclass(frozen=True)
class ClassCode:
    """A chunk's changes ranked within their exponent classes, in class-major order: what ctx codes.

    Per active class (ascending): ``active`` (the class), ``counts`` (its changes), ``n_big`` (those
    with ``|d| > 1``), ``k_pos`` / ``k_bg`` / ``k_bv`` (Rice parameters of its rank gaps, large-value
    gaps and large values). Per change: ``gaps`` (rank gaps), ``ks_pos`` (its class's ``k_pos``),
    ``neg`` (sign bit), ``pos`` (position). Per large change: ``big_gaps``, ``big_vals``, ``ks_big``,
    ``ks_val``. ``shift`` / ``cbits``: where the class field sits in the bits.
    """

    shift: int
    cbits: int
    active: np.ndarray
    counts: np.ndarray
    n_big: np.ndarray
    k_pos: np.ndarray
    k_bg: np.ndarray
    k_bv: np.ndarray
    gaps: np.ndarray
    ks_pos: np.ndarray
    big_gaps: np.ndarray
    big_vals: np.ndarray
    ks_big: np.ndarray
    ks_val: np.ndarray
    neg: np.ndarray
    pos: np.ndarray


def _group_sums(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    cs = np.concatenate(([0], np.cumsum(values.astype(np.int64))))
    ends = np.cumsum(counts)
    return cs[ends] - cs[ends - counts]


def gaps_in_groups(ranks: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Gaps (r_i - r_{i-1} - 1, first r_0) of increasing ranks, restarting at each group of ``counts``."""
    prev = np.empty_like(ranks)
    prev[1:] = ranks[:-1]
    starts = np.cumsum(counts) - counts
    prev[starts[counts > 0]] = -1
    return ranks - prev - 1


def ranks_in_groups(gaps: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Inverse of :func:`gaps_in_groups`."""
    if gaps.size == 0:
        return np.zeros(0, dtype=np.int64)
    cs = np.cumsum(gaps.astype(np.int64) + 1)
    starts = np.cumsum(counts) - counts
    base = np.where(starts > 0, cs[np.maximum(starts - 1, 0)], 0)
    return cs - 1 - np.repeat(base, counts)


def _arrays_numpy(
    old: np.ndarray, new: np.ndarray, shift: int, mask: int, width: int
) -> tuple[np.ndarray, ...]:
    """Everything the encoder codes, in class-major order (the numba kernel ctx_arrays mirrors this)."""
    pos, cls, rank = kernels.class_ranks(old, new, shift, mask)
    order = np.argsort(cls, kind="stable")
    pos, cls, rank = pos[order], cls[order], rank[order]
    active, counts = np.unique(cls, return_counts=True)
    idx = np.repeat(np.arange(active.size), counts)
    gaps = gaps_in_groups(rank, counts)
    d = (new[pos].astype(np.int64) - old[pos].astype(np.int64)) % (1 << width)
    neg = d >= (1 << (width - 1))
    mag = np.where(neg, (1 << width) - d, d) - 1  # |d| - 1 >= 0; mostly 0
    big = np.flatnonzero(mag > 0)
    big_idx = idx[big]
    n_big = np.bincount(big_idx, minlength=active.size).astype(np.int64)
    within = np.arange(idx.size) - np.repeat(np.cumsum(counts) - counts, counts)
    big_gaps = gaps_in_groups(within[big], n_big)
    big_vals = mag[big] - 1
    k_pos = bitio.rice_k(_group_sums(gaps, counts), counts)
    k_bg = bitio.rice_k(_group_sums(big_gaps, n_big), n_big)
    k_bv = bitio.rice_k(_group_sums(big_vals, n_big), n_big)
    u64 = np.uint64
    return (
        active.astype(np.int64),
        counts.astype(np.int64),
        n_big,
        k_pos,
        k_bg,
        k_bv,
        gaps.astype(u64),
        k_pos[idx],
        big_gaps.astype(u64),
        big_vals.astype(u64),
        k_bg[big_idx],
        k_bv[big_idx],
        neg.astype(np.uint8),
        pos,
    )


def rank_classes(old: np.ndarray, new: np.ndarray, dtype: str, *, cell: bool = False,
                 field: tuple[int, int] | None = None) -> ClassCode:  # fmt: skip
    """Detect the chunk's changes and rank them within their exponent classes (the ctx code arrays);
    ``cell``: the coarser class field of a small grid cell's chunk (``CELL_CLASS_FIELDS``);
    ``field``: ``(shift, cbits)`` given (a ``ctxs`` chunk's, from its tensor's class record)."""
    shift, cbits = field or (CELL_CLASS_FIELDS if cell else CLASS_FIELDS)[dtype]
    width = old.dtype.itemsize * 8
    jit = kernels.jit()
    if jit is not None:
        arrays = jit.ctx_arrays(old, new, shift, (1 << cbits) - 1, width)
    else:
        arrays = _arrays_numpy(old, new, shift, (1 << cbits) - 1, width)
    return ClassCode(shift, cbits, *arrays)
